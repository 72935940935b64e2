"""`mpidl launch`'s promise on whatever MPI runs the suite (tests/run.py runs this file with
Open MPI's wheel, and in `--mpi mpich` / `--mpi impi` with Hydra's): a second SIGTERM
aborts the job at once, ranks included, and an abort is not a preemption (not 75).

Each MPI aborts its own way (hpc.launch.FAMILIES): Open MPI's mpiexec on a SIGTERM,
Hydra's on a second SIGINT; Hydra forwards every SIGTERM to the ranks, so passing the
second SIGTERM on would only ask them again to stop.
"""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from hpc.launch import family_of, mpiexec_path, process_rank
from mpidl.testing.launch import launch_env, mpiexec_command, start

pytestmark = pytest.mark.timeout(180)

# Ranks that take SIGTERM and SIGUSR1 as a request and never stop for it (a checkpoint
# that takes for ever): only an abort ends them.
STUBBORN = textwrap.dedent("""
    import signal, sys, time
    from mpidl.comm import world

    got = []
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, lambda n, f: got.append(n))
    comm = world()
    comm.barrier()
    print("rank", comm.rank, "ready", flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
""")


def _ranks_of(tag: str) -> list[int]:
    """The pids of live rank processes whose command line names ``tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read()
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag.encode() in argv and state != "Z" and process_rank(int(pid)) is not None:
            found.append(int(pid))
    return found


def test_a_second_sigterm_aborts_the_job_and_its_ranks(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    cmd = mpiexec_command(2, [sys.executable, "-m", "mpidl", "run", str(script)])
    proc = start([sys.executable, "-m", "mpidl", "launch", *cmd[1:]], launch_env(), settle=0.0)
    try:
        deadline = time.monotonic() + 90
        while len(_ranks_of(str(script))) < 2 or not all(
                _catches(p) for p in _ranks_of(str(script))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # a request the ranks note and ignore
        time.sleep(2)
        assert proc.poll() is None, proc.communicate()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # abort
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    family = family_of(mpiexec_path())
    assert proc.returncode not in (0, 75), (proc.returncode, out + err)
    assert "second SIGTERM: aborting the job" in err and family.name in err, err
    assert took < 60
    deadline = time.monotonic() + 10
    while _ranks_of(str(script)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ranks_of(str(script)) == [], "ranks left running after the abort"


def _catches(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signal.SIGTERM - 1) & 1)
