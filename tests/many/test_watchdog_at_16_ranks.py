"""The watchdog at 16 ranks: a rank that stops joining ends the job with the watchdog's
status, within MPIDL_TIMEOUT and its wait for answers, naming the rank.

Single-process (it launches its own ranks); part of the many-rank tier, tests/many.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_watchdog import STOP  # noqa: E402

from mpidl.comm.watchdog import EXIT_HUNG  # noqa: E402
from mpidl.testing.launch import mpiexec  # noqa: E402

pytestmark = pytest.mark.timeout(150)

RANKS, TIMEOUT = 16, 5


def test_the_watchdog_ends_a_16_rank_job_in_which_a_rank_stops(tmp_path):
    from hpc.env import detect

    if detect().size > 1:
        pytest.skip("launches its own ranks: runs in a single process")
    path = tmp_path / "job.py"
    path.write_text(STOP)  # the last rank stops (SIGSTOP) after the first allreduce
    result = mpiexec(RANKS, [sys.executable, "-m", "mpidl", "run", str(path)], timeout=120,
                     env={"MPIDL_TIMEOUT": str(TIMEOUT)})
    assert result.returncode == EXIT_HUNG, result.output[-3000:]
    assert f"never arrived: {RANKS - 1}" in result.stderr, result.stderr[-3000:]
    assert f"rank {RANKS - 1}: no answer in" in result.stderr, result.stderr[-3000:]
    print(f"{RANKS} ranks, one stopped: the job ended after {result.seconds:.1f} s "
          f"(MPIDL_TIMEOUT={TIMEOUT})")
