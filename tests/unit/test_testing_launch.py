"""The test launcher: it tries again only when Open MPI's launcher failed before any rank
ran, and it stops a job that outlives its limit with SIGTERM before SIGKILL.

The real startup failure cannot be provoked on demand, so those launches are scripted
outcomes: the failure CI saw (its text as `prterun` printed it), then what came next.
"""
from __future__ import annotations

import pytest

from mpidl.testing.launch import Launched, launcher_failed_to_start, retry_startup

PMIX = ("--------------------------------------------------------------------------\n"
        "The PMIx server's listener thread failed to start. We cannot\ncontinue.\n"
        "--------------------------------------------------------------------------\n")


def scripted(*outcomes):
    """A launch that returns ``outcomes`` in turn, and the list of launches made."""
    calls = []

    def launch():
        calls.append(len(calls))
        return outcomes[len(calls) - 1]
    return launch, calls


def test_a_startup_failure_is_launched_again_and_the_next_outcome_returned(capsys):
    ok = Launched(0, "trained\n", "", 1.0)
    launch, calls = scripted(Launched(213, "", PMIX, 0.01), ok)
    assert retry_startup(launch) is ok
    assert len(calls) == 2
    assert "the launcher failed to start (exit 213" in capsys.readouterr().err


def test_retries_are_bounded_and_the_last_failure_is_returned():
    failed = Launched(213, "", PMIX, 0.01)
    launch, calls = scripted(failed, failed, failed, failed)
    assert retry_startup(launch, retries=2) is failed
    assert len(calls) == 3


def test_a_failure_of_the_job_itself_is_never_retried():
    # A rank ran (stdout), or the message is another one: the job's own outcome.
    ran = Launched(1, "step 1\n", PMIX, 2.0)
    refused = Launched(2, "", "mpidl train: error: bad data\n", 0.5)
    for outcome in (ran, refused, Launched(0, "", PMIX, 0.01)):
        assert not launcher_failed_to_start(outcome)
        launch, calls = scripted(outcome, outcome)
        assert retry_startup(launch) is outcome
        assert len(calls) == 1


def test_a_timed_out_job_is_sent_sigterm_first_so_that_it_can_clean_up(tmp_path):
    # (Open MPI's mpiexec removes its session directory on SIGTERM, not on SIGKILL.)
    from mpidl.testing.launch import LaunchTimeout, run

    marker = tmp_path / "term"
    script = f"trap 'echo cleaned > {marker}; exit 0' TERM; sleep 30 & wait"
    with pytest.raises(LaunchTimeout, match="did not finish in 1 s"):
        run(["sh", "-c", script], timeout=1)
    assert marker.read_text() == "cleaned\n"


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace(monkeypatch):
    import time

    import mpidl.testing.launch as launch

    monkeypatch.setattr(launch, "STOP_GRACE_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(launch.LaunchTimeout):
        launch.run(["sh", "-c", "trap '' TERM; sleep 30 & wait; sleep 30"], timeout=0.5)
    assert time.monotonic() - t0 < 10


def test_start_returns_a_running_job_and_names_one_that_ends_at_once():
    from mpidl.testing.launch import start

    proc = start(["sleep", "5"], settle=0.2)
    assert proc.poll() is None
    proc.kill()
    proc.wait()
    with pytest.raises(AssertionError, match=r"ended at once \(exit 3\) after 1 launch"):
        start(["sh", "-c", "echo nope >&2; exit 3"], settle=2)
