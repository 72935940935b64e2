"""A check that fails on one rank only fails the test on every rank, at once, with that
rank's reason; the ranks then go on together to the next test.

The alternative is what a plain ``assert`` does: the failing rank leaves the test, the
others wait in the next collective until the per-test timeout kills them.
"""
from __future__ import annotations

import os
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from mpidl.testing.launch import mpiexec

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANKS = 2
PER_TEST_TIMEOUT = 60  # what a hang would cost each test below

TESTS = textwrap.dedent(f'''
    import numpy
    import pytest

    from mpidl.comm import world
    from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks, raises_all_ranks

    pytestmark = [pytest.mark.mpi, pytest.mark.timeout({PER_TEST_TIMEOUT})]
    comm = world()
    last = comm.rank == comm.size - 1


    def test_flag():
        assert_all_ranks(comm, not last, f"rank {{comm.rank}} saw 42")


    def test_arrays():
        assert_allclose_all_ranks(comm, numpy.full(3, 1.0 + last), numpy.ones(3), what="x")


    def test_raises():
        with raises_all_ranks(comm, ValueError, match="bad"):
            if not last:
                raise ValueError("bad value")


    def test_raises_another_exception():
        with raises_all_ranks(comm, ValueError):
            raise (KeyError if last else ValueError)("k")


    def test_the_ranks_go_on_together():
        comm.barrier()
        assert_all_ranks(comm, comm.allgather_obj(comm.rank) == list(range(comm.size)))
''')


def test_a_failure_on_one_rank_fails_every_rank_quickly_and_names_it(tmp_path):
    (tmp_path / "test_one_rank_fails.py").write_text(TESTS)
    reports = tmp_path / "reports"
    reports.mkdir()
    # tests/run.py's worker: pytest on every rank, one JUnit report per rank.
    result = mpiexec(RANKS, [sys.executable, os.path.join(ROOT, "tests", "run.py"), "--worker",
                             str(reports), "--", str(tmp_path / "test_one_rank_fails.py"),
                             "-p", "no:cacheprovider", f"--rootdir={tmp_path}"],
                     timeout=180, cwd=str(tmp_path),
                     env={"PYTHONPATH": os.pathsep.join(filter(None, [
                         ROOT, os.environ.get("PYTHONPATH")]))})
    assert result.seconds < PER_TEST_TIMEOUT, f"took {result.seconds:.0f} s: a rank waited"
    bad = RANKS - 1
    expected = {
        "test_flag": f"rank {bad}: rank {bad} saw 42",
        "test_arrays": f"rank {bad}: x: 3 of 3 elements differ",
        "test_raises": f"rank {bad}: did not raise ValueError",
        "test_raises_another_exception": f"rank {bad}: raised KeyError: 'k' (expected ValueError)",
    }
    for rank in range(RANKS):
        path = reports / f"rank-{rank}.xml"
        assert path.exists(), f"rank {rank} wrote no report:\n{result.output}"
        cases = {c.get("name"): c for c in ET.parse(path).getroot().iter("testcase")}
        assert set(cases) == set(expected) | {"test_the_ranks_go_on_together"}, cases
        for name, reason in expected.items():
            failure = cases[name].find("failure")
            assert failure is not None, f"rank {rank}: {name} passed"
            text = failure.get("message", "") + (failure.text or "")
            assert f"failed on 1 of {RANKS} ranks ({bad})" in text and reason in text, \
                f"rank {rank}, {name}: {text[-2000:]}"
        last = cases["test_the_ranks_go_on_together"]
        assert last.find("failure") is None and last.find("error") is None, f"rank {rank}"
