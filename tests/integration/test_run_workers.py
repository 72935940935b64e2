"""tests/run.py's MPI workers, launched as the MPI tiers launch them: one pytest per rank."""
from __future__ import annotations

import os
import sys

import pytest

from mpidl.testing.launch import mpiexec

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "tests", "run.py")

# Each rank writes where its tmp_path is, into a file named after its rank.
PROBE = '''
import os

from hpc.env import detect


def test_where_tmp_path_is(tmp_path):
    rank = detect().rank
    with open(os.path.join(os.environ["PROBE_OUT"], f"rank-{rank}"), "w") as f:
        f.write(str(tmp_path))
'''


@pytest.mark.parametrize("n", [2, 3])
def test_each_rank_keeps_its_tmp_paths_in_a_folder_of_its_own_then_removes_it(tmp_path, n):
    # Ranks that share pytest's default root prune each other's folders at exit (CI: one
    # of 16 ranks failed after every test passed). tests/conftest.py gives each rank a
    # root of its own, under every launcher (`tests/run.py --mpi mpich` runs this under
    # Hydra, which names no job); the probe lies outside the tests folder, so it is loaded
    # by name (run.py runs from tests/, where `conftest` is tests/conftest.py).
    (tmp_path / "test_probe.py").write_text(PROBE)
    report, out = tmp_path / "report", tmp_path / "out"
    report.mkdir()
    out.mkdir()
    result = mpiexec(n, [sys.executable, RUN, "--worker", str(report), "--",
                         str(tmp_path / "test_probe.py"), "-p", "no:cacheprovider",
                         "-p", "conftest"],
                     timeout=120, env={"PROBE_OUT": str(out)}, cwd=ROOT)
    assert result.returncode == 0, result.output
    where = {r: (out / f"rank-{r}").read_text() for r in range(n)}
    roots = set()
    for r, path in where.items():
        assert f"-rank{r}{os.sep}" in path, where
        root = path[:path.index(f"-rank{r}{os.sep}") + len(f"-rank{r}")]
        assert os.path.basename(root).startswith("mpidl-pytest-"), where
        assert "pytest-of-" not in path, where
        assert not os.path.exists(root), f"{root} left behind"
        roots.add(root)
    assert len(roots) == n, where
