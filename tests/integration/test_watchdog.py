"""Collective mismatches, stopped and exited ranks end the job with a report, never a hang.

Each test launches a small script with ``mpidl run`` on real ranks, a short
``MPIDL_TIMEOUT`` and a wall-clock limit (a hang fails the test by LaunchTimeout).
"""
from __future__ import annotations

import sys
import textwrap

import pytest

from mpidl.comm.watchdog import EXIT_HUNG
from mpidl.testing.launch import mpiexec

pytestmark = pytest.mark.timeout(120)

SKIP = textwrap.dedent("""
    import numpy
    from mpidl.comm import world

    comm = world()
    x = numpy.ones(4)
    comm.allreduce_(x)
    if comm.rank != 1:
        comm.allreduce_(x)          # rank 1 skips this one
    comm.allreduce_(x)              # ... so its third pairs with the others' second
    print("rank", comm.rank, "sum", x[0], flush=True)
    comm.barrier()
""")

BARRIER_VS_ALLREDUCE = textwrap.dedent("""
    import numpy
    from mpidl.comm import world

    comm = world()
    if comm.rank == 0:
        comm.barrier()
    else:
        comm.allreduce_(numpy.ones(3))
""")

EXIT = textwrap.dedent("""
    import sys
    import numpy
    from mpidl.comm import world

    comm = world()
    comm.allreduce_(numpy.ones(3))
    if comm.rank == 1:
        {how}
    comm.allreduce_(numpy.ones(3))
    print("unreachable: rank", comm.rank, flush=True)
""")

STOP = textwrap.dedent("""
    import os, signal
    import numpy
    from mpidl.comm import world

    comm = world()
    comm.allreduce_(numpy.ones(3))
    if comm.rank == comm.size - 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    comm.allreduce_(numpy.ones(3))
""")

PATIENT = textwrap.dedent("""
    import time
    import numpy
    from mpidl.comm import world
    from mpidl.comm.ledger import patience

    comm = world()
    if comm.rank == 0:
        time.sleep(4)               # longer than the timeout, but the others are patient
    with patience("rank 0 prepares the data"):
        comm.barrier()
    x = comm.allreduce(numpy.ones(3))
    print("rank", comm.rank, "done", x[0], flush=True)
""")


def _launch(tmp_path, n, text, env=None, timeout=90):
    path = tmp_path / "job.py"
    path.write_text(text)
    return mpiexec(n, [sys.executable, "-m", "mpidl", "run", str(path)], timeout=timeout,
                   env=env)


@pytest.mark.parametrize("n", [2, 3])
def test_a_skipped_collective_in_check_mode_raises_on_every_rank_naming_the_calls(tmp_path, n):
    result = _launch(tmp_path, n, SKIP, env={"MPIDL_CHECK_COLLECTIVES": "1",
                                             "MPIDL_TIMEOUT": "60"})
    assert result.returncode == 1, result.output
    assert result.seconds < 20, f"took {result.seconds:.1f} s"
    err = result.stderr
    assert "collective mismatch on communicator 'world'" in err, err
    others = "ranks 0, 2" if n == 3 else "rank 0"
    assert f"{others}: #2 allreduce_(shape (4,), float64, op=sum) at job.py:9" in err, err
    assert "rank 1: #2 allreduce_(shape (4,), float64, op=sum) at job.py:10" in err, err
    assert " sum " not in result.stdout  # nobody went on with a wrong sum


def test_a_skipped_collective_without_checks_is_ended_by_the_watchdog_naming_the_rank(tmp_path):
    result = _launch(tmp_path, 3, SKIP, env={"MPIDL_TIMEOUT": "3"})
    assert result.returncode == EXIT_HUNG == 124, result.output  # not 1, as a traceback
    assert result.seconds < 30, f"took {result.seconds:.1f} s"
    err = result.stderr
    assert "mpidl watchdog: rank" in err and "longer than the timeout (3 s" in err, err
    assert ("in allreduce_ #3 at job.py:10 in <module> on 'world': ranks 0, 2; "
            "never arrived: 1") in err, err
    assert "rank 1: in barrier #3 at job.py:12" in err, err
    # Every rank printed its stack and its last collectives.
    for r in range(3):
        assert f"rank {r}/3: Python stack of every thread:" in err, err
        assert f"rank {r}/3: collectives on 'world', last first:" in err, err


def test_a_barrier_against_an_allreduce_is_named_in_check_mode(tmp_path):
    result = _launch(tmp_path, 2, BARRIER_VS_ALLREDUCE,
                     env={"MPIDL_CHECK_COLLECTIVES": "1", "MPIDL_TIMEOUT": "60"})
    assert result.returncode == 1 and result.seconds < 20, result.output
    assert "rank 0: #1 barrier() at job.py:7" in result.stderr, result.stderr
    assert "rank 1: #1 allreduce_(shape (3,), float64, op=sum) at job.py:9" in result.stderr


def test_a_barrier_against_an_allreduce_is_ended_by_the_watchdog(tmp_path):
    result = _launch(tmp_path, 2, BARRIER_VS_ALLREDUCE, env={"MPIDL_TIMEOUT": "3"})
    assert result.returncode == EXIT_HUNG and result.seconds < 30, result.output
    assert "rank 0: in barrier #1 at job.py:7" in result.stderr, result.stderr
    assert "rank 1: in allreduce_ #1 at job.py:9" in result.stderr, result.stderr


@pytest.mark.parametrize("how,status", [("sys.exit(0)", 0), ("sys.exit(3)", 3),
                                        ("raise SystemExit('bye')", "bye")])
def test_a_rank_that_exits_while_others_wait_ends_the_job(tmp_path, how, status):
    # A long timeout: the exit notice, not the timeout, ends the job.
    result = _launch(tmp_path, 3, EXIT.format(how=how), env={"MPIDL_TIMEOUT": "300"})
    assert result.returncode == EXIT_HUNG, result.output
    assert result.seconds < 30, f"took {result.seconds:.1f} s"
    assert f"rank 1 has exited (status {status})" in result.stderr, result.stderr
    assert "never arrived: 1" in result.stderr
    assert "unreachable" not in result.stdout


def test_a_stopped_rank_is_named_as_not_answering(tmp_path):
    result = _launch(tmp_path, 3, STOP, env={"MPIDL_TIMEOUT": "3"})
    assert result.returncode == EXIT_HUNG and result.seconds < 40, result.output
    assert "rank 2: no answer in 5 s: stopped, dead, or holding the GIL" in result.stderr
    assert "never arrived: 2" in result.stderr, result.stderr


def test_a_patient_wait_outlasts_the_timeout_and_the_job_ends_normally(tmp_path):
    result = _launch(tmp_path, 2, PATIENT, env={"MPIDL_TIMEOUT": "2"})
    assert result.returncode == 0, result.output
    assert result.stdout.count("done 2.0") == 2, result.output
    assert "watchdog" not in result.stderr


def test_the_watchdog_is_off_with_a_zero_timeout(tmp_path):
    # Off: the mismatch is not reported by it (the launch limit ends the job instead).
    from mpidl.testing.launch import LaunchTimeout

    with pytest.raises(LaunchTimeout):
        _launch(tmp_path, 2, BARRIER_VS_ALLREDUCE, env={"MPIDL_TIMEOUT": "0"}, timeout=8)


def test_a_bad_timeout_value_is_a_clear_error(tmp_path):
    result = _launch(tmp_path, 2, "from mpidl.comm import world\nworld()\n",
                     env={"MPIDL_TIMEOUT": "soon"})
    assert result.returncode != 0
    assert "MPIDL_TIMEOUT='soon' is not a number of seconds >= 0" in result.stderr


RECV_NEVER_SENT = textwrap.dedent("""
    import numpy
    from mpidl.comm import world

    comm = world()
    if comm.rank == 1:
        comm.recv_(numpy.empty(3), 0, tag=1)   # rank 0 never sends it
    comm.barrier()
""")


def test_a_receive_whose_send_never_comes_is_ended_by_the_watchdog_naming_the_peer(tmp_path):
    result = _launch(tmp_path, 2, RECV_NEVER_SENT, env={"MPIDL_TIMEOUT": "3"})
    assert result.returncode == EXIT_HUNG and result.seconds < 30, result.output
    assert "rank 1: in irecv_ p2p #1 from world rank 0 at job.py:7" in result.stderr, \
        result.stderr
    assert "rank 0: in barrier #1 at job.py:8" in result.stderr, result.stderr
