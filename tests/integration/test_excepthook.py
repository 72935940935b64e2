"""An exception on one rank ends the whole job quickly, with that rank's traceback."""
from __future__ import annotations

import sys
import textwrap

import pytest

from mpidl.testing.launch import mpiexec

pytestmark = pytest.mark.timeout(90)

SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy
    from mpidl.comm import world

    comm = world()
    if comm.rank == int(sys.argv[1]):
        raise ValueError("deliberate failure on rank %d" % comm.rank)
    comm.allreduce_(numpy.zeros(3))   # the other ranks would wait here forever
    print("unreachable: rank", comm.rank, "got past the collective")
""")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "fails.py"
    path.write_text(SCRIPT)
    return str(path)


def test_exception_on_rank_1_of_3_aborts_the_job_within_10_s(script):
    result = mpiexec(3, [sys.executable, "-m", "mpidl", "run", script, "1"], timeout=60)
    assert result.returncode != 0
    assert result.seconds < 10, f"took {result.seconds:.1f} s"
    assert "rank 1/3: ValueError: deliberate failure on rank 1" in result.stderr
    assert "rank 1/3: Traceback (most recent call last):" in result.stderr
    assert "unreachable" not in result.stdout


def test_console_script_form_also_aborts(script):
    import os
    import shutil

    exe = os.path.join(os.path.dirname(sys.executable), "mpidl")
    exe = exe if os.path.exists(exe) else shutil.which("mpidl")
    if exe is None:
        pytest.skip("the mpidl console script is not installed (pip install -e .)")
    result = mpiexec(2, [exe, "run", script, "0"], timeout=60)
    assert result.returncode != 0 and "rank 0/2: ValueError" in result.stderr


def test_distributed_error_exits_every_rank_with_one_message(tmp_path):
    path = tmp_path / "check.py"
    path.write_text(textwrap.dedent("""
        from mpidl.comm import world
        comm = world()
        comm.check(comm.rank != comm.size - 1, "value 7 is out of range [0, 5)")
    """))
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "run", str(path)], timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("mpidl: error: check failed on rank 1 of 2") == 1
    assert "rank 1: value 7 is out of range [0, 5)" in result.stderr


def test_a_failed_check_on_a_sub_communicator_aborts_the_other_ranks(tmp_path):
    # Only rank 0's group raises; rank 1 waits in a world barrier: it must be aborted.
    path = tmp_path / "subcheck.py"
    path.write_text(textwrap.dedent("""
        from mpidl.comm import world
        comm = world()
        group = comm.split(comm.rank)
        if comm.rank == 0:
            group.check(False, "bad shard on rank 0")
        comm.barrier()
        print("unreachable: rank", comm.rank, "got past the barrier")
    """))
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "run", str(path)], timeout=60)
    assert result.returncode != 0 and result.seconds < 20, result.output
    assert "rank 0/2: unhandled exception; aborting all 2 ranks" in result.stderr
    assert "bad shard on rank 0" in result.stderr and "unreachable" not in result.stdout


def test_a_script_imports_the_modules_next_to_it(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    (tmp_path / "main.py").write_text("import helper\nprint('ok', helper.VALUE)\n")
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "run", str(tmp_path / "main.py")],
                     timeout=60)
    assert result.returncode == 0, result.output
    assert result.stdout.count("ok 42") == 2


def test_script_that_succeeds_exits_zero_on_every_rank(tmp_path):
    path = tmp_path / "ok.py"
    path.write_text("import sys\nfrom mpidl.comm import world\n"
                    "c = world()\nprint('ok', c.rank, c.size, sys.argv[1:])\n")
    result = mpiexec(3, [sys.executable, "-m", "mpidl", "run", str(path), "a", "b"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("ok")) == \
        [f"ok {r} 3 ['a', 'b']" for r in range(3)]
