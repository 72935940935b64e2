"""The signal contract of `mpidl train`, from its first instruction to its last: SIGTERM to
`mpidl launch` (or SIGUSR1 to mpiexec, or a signal to one rank) at any moment ends the job
with status 75 and leaves no temporary file behind.

Each case starts a real 2-rank job, waits until the job shows it reached a phase (a rank
process exists, a temporary corpus folder or shard appears, the run directory or its
checkpoints appear, a record is written), sends the signal at once, and checks the
outcome. Where exactly the signal lands inside a phase varies with the machine; every
landing must end the same way.
"""
from __future__ import annotations

import glob
import os
import signal
import sys
import time

import pytest

from hpc.launch import process_rank
from mpidl.testing.launch import (Launched, launcher_failed_to_start, launch_env,
                                  mpiexec_command, start)
from trainjob import EPOCH, SMALL

pytestmark = [pytest.mark.timeout(300)]

MARKER_TIMEOUT_S = 120


def _ranks(run: str) -> list[int]:
    """The pids of the ranks (Python processes) of the job whose run directory is ``run``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if f"--run-dir={run}".encode() in argv and process_rank(int(pid)) is not None:
            found.append(int(pid))
    return found


def _catches(pid: int, *signals: int) -> bool:
    """Whether process ``pid`` has handlers for ``signals`` (its SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    except (OSError, StopIteration):
        return False
    return all(mask >> (s - 1) & 1 for s in signals)


def _ranks_handle_signals(run: str) -> bool:
    """Both ranks have installed their handlers: they import NumPy and MPI, start MPI."""
    pids = _ranks(run)
    return len(pids) == 2 and all(_catches(p, signal.SIGTERM, signal.SIGUSR1) for p in pids)


def _temporaries(cache: str, run: str) -> list[str]:
    """What a job may leave half-done: corpus build folders, `.tmp` files."""
    found = glob.glob(os.path.join(cache, ".reviews-*"))
    for root, dirs, files in os.walk(run):
        found += [os.path.join(root, n) for n in dirs + files if ".tmp" in n]
    return found


def _nonempty(path: str) -> bool:
    return os.path.exists(path) and os.path.getsize(path) > 0


def _mpiexec_started(run: str, launcher: int) -> bool:
    """`mpidl launch` (pid ``launcher``) has started mpiexec: its children, read from the
    kernel's list (polled every 5 ms, well before mpiexec's proxies start the ranks: the
    moment MPICH's and Intel MPI's mpiexec lose a signal). Not "no rank is up": that is
    also true again once the job has ended, while mpiexec tears down."""
    try:
        with open(f"/proc/{launcher}/task/{launcher}/children") as f:
            children = f.read().split()
    except OSError:
        return False
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if os.path.basename(argv[0]).startswith(b"mpiexec") and f"--run-dir={run}".encode() in argv:
            return True
    return False


# phase -> (training arguments, "the job is in it now", given the cache, the run
# directory and the pid of the process the test started)
PHASES = {
    "before the ranks are up": ([], lambda cache, run, launcher:
                                _mpiexec_started(run, launcher)),
    # a rank's interpreter starts: no Python code of ours has run yet
    "start-up": ([], lambda cache, run, launcher: bool(_ranks(run))),
    "import": ([], lambda cache, run, launcher: _ranks_handle_signals(run)),
    "corpus generation": ([], lambda cache, run, launcher: bool(glob.glob(f"{cache}/.reviews-*"))),
    "sharding": ([], lambda cache, run, launcher: bool(glob.glob(f"{cache}/.reviews-*/*/shard-*.h5"))),
    # begin() writes config.toml just before the first step
    "first step": ([], lambda cache, run, launcher: os.path.exists(f"{run}/config.toml")),
    # the first record is the epoch's last step's: the evaluation comes next
    "evaluation": ([f"--log-every={EPOCH}"], lambda cache, run, launcher: _nonempty(f"{run}/metrics.jsonl")),
    # one epoch: its checkpoint is the run's last, then the summary
    "checkpoint writing": (["--epochs=1"], lambda cache, run, launcher: os.path.isdir(f"{run}/checkpoints")),
}


def _signal_at(phase: str, cache: str, run: str, how: str) -> Launched:
    """Start the job, signal it (``how``) once it is in ``phase``; its outcome."""
    args, ready = PHASES[phase]
    cmd = mpiexec_command(2, [sys.executable, "-m", "mpidl", "train", *SMALL,
                              f"--data.cache-dir={cache}", f"--run-dir={run}", *args])
    if how == "SIGTERM to mpidl launch":
        cmd = [sys.executable, "-m", "mpidl", "launch", *cmd[1:]]
    for _ in range(3):  # a launcher that fails to start is started again
        proc = start(cmd, launch_env(), settle=0.0)
        deadline = time.monotonic() + MARKER_TIMEOUT_S
        try:
            while proc.poll() is None and not ready(cache, run, proc.pid):
                assert time.monotonic() < deadline, f"the job never reached {phase}"
                time.sleep(0.005)
            if proc.poll() is None:
                if how == "SIGTERM to rank 1":
                    _signal_rank(run, 1, signal.SIGTERM)
                else:
                    proc.send_signal(signal.SIGTERM if "SIGTERM" in how else signal.SIGUSR1)
            out, err = proc.communicate(timeout=MARKER_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        result = Launched(proc.returncode, out, err, 0.0)
        if not launcher_failed_to_start(result):
            return result
    return result


def _signal_rank(run: str, rank: int, sig: int) -> None:
    for pid in _ranks(run):
        if process_rank(pid) == rank:
            os.kill(pid, sig)
            return
    raise AssertionError(f"rank {rank} of the job in {run} not found")


@pytest.mark.parametrize("phase,how", [
    ("before the ranks are up", "SIGTERM to mpidl launch"),
    ("start-up", "SIGTERM to mpidl launch"),
    ("import", "SIGTERM to mpidl launch"),
    ("corpus generation", "SIGTERM to mpidl launch"),
    ("corpus generation", "SIGUSR1 to mpiexec"),
    ("corpus generation", "SIGTERM to rank 1"),
    ("sharding", "SIGTERM to mpidl launch"),
    ("first step", "SIGTERM to mpidl launch"),
    ("evaluation", "SIGUSR1 to mpiexec"),
    ("checkpoint writing", "SIGTERM to mpidl launch"),
])
def test_a_signal_in_any_phase_ends_the_job_with_75_and_no_temporary_files(
        tmp_path, phase, how):
    cache, run = str(tmp_path / "cache"), str(tmp_path / "run")
    result = _signal_at(phase, cache, run, how)
    assert result.returncode == 75, result.output
    assert "exiting with 75" in result.output, result.output
    assert "Traceback" not in result.output, result.output
    assert _temporaries(cache, run) == []
    if phase not in ("before the ranks are up", "start-up"):
        # the ranks caught it themselves (the launcher did not map it)
        assert "mpidl launch: the job ended by the" not in result.output, result.output
    if phase in ("first step", "evaluation", "checkpoint writing"):
        # training had begun: a checkpoint to resume from
        saved = glob.glob(os.path.join(run, "checkpoints", "checkpoint-*.h5"))
        assert saved and max(int(p.rsplit("-", 1)[1][:8]) for p in saved) >= 1, saved
