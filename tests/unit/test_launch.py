"""`mpidl launch` (hpc.launch): what each signal becomes for mpiexec, and its exit status.

A stand-in for mpiexec (``--launcher=``) records the signals it gets; no MPI is needed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import hpc.launch

# A stand-in for one family's mpiexec: `--version` says the family's words; then it writes
# "ready" once its handlers are in, and each signal's name as it arrives. It exits 1 once
# the family's abort has come in full (the last signals), and on the family's preemption
# signal, by mode: "catch" exits 75 (as mpidl train), "note" goes on, "die" leaves it to
# its default action (a rank that had not set up its handler yet), "deaf" notes the first
# one as lost (mpiexec before its proxies) and exits 75 on the next, "hydra-died" prints
# DIED_SAYS and exits DIED_STATUS (Hydra reporting a rank that died of it);
# "suicide" kills itself with the preemption signal unasked.
FAKE_MPIEXEC = textwrap.dedent("""
    import os, signal, sys, time
    if sys.argv[1] == "--version":
        print(os.environ["FAKE_SAYS"])
        sys.exit(0)
    log, mode = sys.argv[1], sys.argv[2]
    preempt = getattr(signal, os.environ["FAKE_PREEMPT"])
    abort = os.environ["FAKE_ABORT"].split()
    seen = []
    def note(text):
        seen.append(text)
        with open(log, "a") as f:
            f.write(text + "\\n")
    def handle(signum, frame):
        name = signal.Signals(signum).name
        if signum == preempt and mode == "deaf" and "lost" not in seen:
            note("lost")
            return
        note(name)
        if abort and seen[-len(abort):] == abort and len(seen) > len(abort) + 1:
            sys.exit(1)
        if signum == preempt and mode in ("catch", "deaf"):
            sys.exit(75)
        if signum == preempt and mode == "hydra-died":
            print(os.environ["DIED_SAYS"], flush=True)
            sys.exit(int(os.environ["DIED_STATUS"]))
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        if s != preempt or mode not in ("die", "suicide"):
            signal.signal(s, handle)
    note("ready")
    if mode == "suicide":
        os.kill(os.getpid(), preempt)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
""")

# What each family's `mpiexec --version` says (hpc.launch.FAMILIES).
SAYS = {hpc.launch.OPEN_MPI: "mpiexec (Open MPI) 5.0.11",
        hpc.launch.MPICH: "HYDRA build details:\n    Version: 5.0.2",
        hpc.launch.INTEL_MPI: "Intel(R) MPI Library for Linux* OS, Version 2021.18.1",
        hpc.launch.OTHER: "some launcher 1.0"}
FAMILIES = [pytest.param(f, id=f.name.replace(" ", "-")) for f in SAYS]
# What each family's real mpiexec was seen to do (the stand-in plays it; the table must
# agree): the signal it forwards for the ranks to catch, and what aborts it.
MEASURED = {hpc.launch.OPEN_MPI: ("SIGUSR1", ["SIGTERM"]),
            hpc.launch.MPICH: ("SIGTERM", ["SIGINT", "SIGINT"]),
            hpc.launch.INTEL_MPI: ("SIGTERM", ["SIGINT", "SIGINT"]),
            hpc.launch.OTHER: ("SIGTERM", [])}


def _launch(tmp_path, mode, family=hpc.launch.OPEN_MPI, env=None):
    script = tmp_path / "fake_mpiexec.py"
    script.write_text(FAKE_MPIEXEC)
    launcher = tmp_path / "mpiexec"
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    launcher.chmod(0o755)
    log = tmp_path / "signals.log"
    preempt, abort = MEASURED[family]
    env = dict(os.environ, FAKE_SAYS=SAYS[family], FAKE_PREEMPT=preempt,
               FAKE_ABORT=" ".join(abort), **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "mpidl", "launch", f"--launcher={launcher}",
                             str(log), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    deadline = time.monotonic() + 60
    while not (log.exists() and "ready" in log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    return proc, log


def _finish(proc):
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out + err


@pytest.mark.parametrize("family", FAMILIES)
def test_sigterm_becomes_the_familys_preemption_and_its_status_is_returned(tmp_path, family):
    proc, log = _launch(tmp_path, "catch", family)
    proc.send_signal(signal.SIGTERM)
    code, output = _finish(proc)
    assert code == 75, output
    assert log.read_text().split() == ["ready", MEASURED[family][0]]
    said = "send SIGTERM again to abort" if family.abort else "passed on as it is"
    assert said in output and f"to {family.name}'s mpiexec" in output


def _wait_for(log, line):
    deadline = time.monotonic() + 60
    while line not in log.read_text().split():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)


@pytest.mark.parametrize("family", [f for f in FAMILIES if MEASURED[f.values[0]][1]])
def test_a_second_sigterm_aborts_as_the_family_aborts(tmp_path, family):
    # Open MPI aborts on a SIGTERM; Hydra forwards every SIGTERM to the ranks and aborts
    # on a second SIGINT ("Press Ctrl-C again to force abort"), measured.
    proc, log = _launch(tmp_path, "note", family)
    proc.send_signal(signal.SIGTERM)
    preempt, abort = MEASURED[family]
    _wait_for(log, preempt)
    proc.send_signal(signal.SIGTERM)
    code, output = _finish(proc)
    assert code == 1, output  # an abort is not a preemption
    seen = log.read_text().split()
    assert seen[0] == "ready" and seen[-len(abort):] == abort, seen
    assert set(seen[1:-len(abort)]) == {preempt}, seen  # sent again until then
    assert "second SIGTERM: aborting the job" in output


def test_sigusr2_is_passed_on_as_it_is(tmp_path):
    proc, log = _launch(tmp_path, "note")
    proc.send_signal(signal.SIGUSR2)
    code, output = _finish(proc)
    assert code == 128 + signal.SIGUSR2, output  # its default action ended the child


@pytest.mark.parametrize("family", FAMILIES)
def test_a_job_killed_by_the_relayed_preemption_counts_as_preempted(tmp_path, family):
    # The rank (or mpiexec) got it in its first milliseconds, before any handler.
    proc, log = _launch(tmp_path, "die", family)
    proc.send_signal(signal.SIGTERM)
    code, output = _finish(proc)
    assert code == 75, output
    assert "before a rank (or mpiexec) could catch it" in output


# How Hydra reports a rank killed by the SIGTERM it forwarded (measured: MPICH 5.0.2 and
# Intel MPI 2021.18, mpi4py's wheels), and the same status without those words.
@pytest.mark.parametrize("family,status,says,preempted", [
    (hpc.launch.MPICH, 15, "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Terminated "
                           "(signal 15)", True),
    (hpc.launch.INTEL_MPI, 255, "=   KILLED BY SIGNAL: 15 (Terminated)", True),
    (hpc.launch.INTEL_MPI, 255, "=   EXIT CODE: 255", False),   # a failure, not the signal
    (hpc.launch.MPICH, 15, "=   EXIT CODE: 15", False),
])
def test_hydras_report_of_a_rank_killed_by_the_preemption_counts_as_preempted(
        tmp_path, family, status, says, preempted):
    proc, log = _launch(tmp_path, "hydra-died", family,
                        {"DIED_SAYS": says, "DIED_STATUS": str(status)})
    proc.send_signal(signal.SIGTERM)
    code, output = _finish(proc)
    assert code == (75 if preempted else status), output
    assert says in output  # passed on


@pytest.mark.parametrize("family", FAMILIES)
def test_a_preemption_the_launcher_lost_is_sent_again_until_it_lands(tmp_path, family):
    # mpiexec loses a signal that comes before its proxies (the job would run to its end
    # and exit 0): the launcher sends it again until mpiexec ends.
    proc, log = _launch(tmp_path, "deaf", family)
    proc.send_signal(signal.SIGTERM)
    code, output = _finish(proc)
    assert code == 75, output
    assert log.read_text().split() == ["ready", "lost", MEASURED[family][0]]


def test_a_job_that_dies_of_the_preemption_signal_unasked_keeps_its_status(tmp_path):
    proc, log = _launch(tmp_path, "suicide")
    code, output = _finish(proc)
    assert code == 128 + signal.SIGUSR1, output


@pytest.fixture
def restored_handlers():
    """main() keeps its handlers (its process ends with mpiexec): put ours back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1,
                                              signal.SIGUSR2, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_sigterm_before_mpiexec_starts_starts_nothing_and_exits_75(
        monkeypatch, capsys, restored_handlers):
    def found_while_signalled():
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the launcher is looked up
        return "/bin/true"

    def never(*args, **kwargs):
        raise AssertionError("mpiexec was started")

    monkeypatch.setattr(hpc.launch, "mpiexec_path", found_while_signalled)
    monkeypatch.setattr(hpc.launch, "family_of", lambda path: hpc.launch.OPEN_MPI)
    monkeypatch.setattr(hpc.launch.subprocess, "Popen", never)
    assert hpc.launch.main(["-n", "2", "true"]) == 75
    assert "preempted before mpiexec started: nothing started" in capsys.readouterr().err


# What Open MPI 5.0.11's mpiexec wrote, and its status 0, when the watchdog aborted a job
# (124) whose node had been cut off (tests/cluster/test_faults.py does it for real).
LOST_NODE = textwrap.dedent("""\
    --------------------------------------------------------------------------
    MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD
      Proc: [[35771,1],0]
      Errorcode: 124

    NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
    You may or may not see output from other processes, depending on
    exactly when Open MPI kills them.
    --------------------------------------------------------------------------
    --------------------------------------------------------------------------
    PRTE has lost communication with a remote daemon.

      HNP daemon   : [prterun-vm-1234@0,0] on node vm
      Remote daemon: [prterun-vm-1234@0,2] on node 10.213.1.3
    --------------------------------------------------------------------------
""")


@pytest.mark.parametrize("said,status", [
    (LOST_NODE, 124),                                   # the abort's code
    (LOST_NODE.split("-" * 74 + "\n", 3)[3], 1),        # lost, no abort: still a failure
    ("an unrelated warning\n", 0),                      # nothing lost: mpiexec's 0
])
def test_a_job_that_lost_a_node_never_exits_0(tmp_path, said, status):
    launcher = tmp_path / "mpiexec"
    (tmp_path / "said.txt").write_text(said)
    launcher.write_text(f"#!/bin/sh\ncat {tmp_path / 'said.txt'} >&2\nexit 0\n")
    launcher.chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "mpidl", "launch", f"--launcher={launcher}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == status, proc.stderr
    assert proc.stderr.startswith(said), proc.stderr  # passed on whole, as it came
    assert ("exited 0 after losing a node's daemon" in proc.stderr) == (status != 0)


def _fake_launcher(path, says):
    path.write_text(f"#!/bin/sh\necho '{says}'\necho asked >> '{path}.log'\n")
    path.chmod(0o755)
    return str(path)


def test_a_launcher_is_asked_for_its_flavour_once_until_it_changes(tmp_path):
    from hpc.launch import is_open_mpi

    ompi = _fake_launcher(tmp_path / "mpiexec", "mpiexec (Open MPI) 5.0.11")
    other = _fake_launcher(tmp_path / "mpiexec.hydra", "HYDRA build details:")
    assert [is_open_mpi(ompi) for _ in range(3)] == [True] * 3
    assert [is_open_mpi(other) for _ in range(2)] == [False] * 2
    assert (tmp_path / "mpiexec.log").read_text().count("asked") == 1
    assert (tmp_path / "mpiexec.hydra.log").read_text().count("asked") == 1
    # Replaced in place (another MPI installed at the same path): asked again.
    _fake_launcher(tmp_path / "mpiexec", "HYDRA build details:")
    os.utime(ompi, ns=(0, 10**9))  # a new modification time, whatever the clock's grain
    assert is_open_mpi(ompi) is False
    assert not is_open_mpi(str(tmp_path / "absent"))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_told_by_its_version_text(tmp_path, family):
    path = _fake_launcher(tmp_path / "mpiexec", SAYS[family].splitlines()[0])
    assert hpc.launch.family_of(path) is family
