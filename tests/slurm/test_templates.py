"""slurm/test.sbatch and a script rendered by `mpidl sbatch`, run on the local Slurm.

    PYTHONPATH=. .venv/bin/python -m pytest -p no:cacheprovider -q tests/slurm
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from slurmci import ROOT, SLURM_DIR, Cluster

pytestmark = pytest.mark.slurm

# One node, two tasks: the templates ask for more than this cluster has.
ONE_NODE = ("--nodes=1", "--ntasks=2", "--cpus-per-task=1", "--time=4")


def _rank_summaries(output: str) -> dict[str, str]:
    """``{"0": "43 passed, 37 skipped in 1.9s", ...}`` from srun --label'd pytest output."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^(\d+): =*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", output, re.M)}


def _assert_two_ranks_passed(output: str, describe: str) -> None:
    # One communicator of size 2, from `mpidl info` and from every pytest-mpi rank; two
    # size-1 singletons (a PMI mismatch) would also exit 0.
    assert re.findall(r"^ranks: (\d+)$", output, re.M) == ["2"], describe
    assert sorted(re.findall(r"^\d+: size: (\d+)$", output, re.M)) == ["2", "2"], describe
    summaries = _rank_summaries(output)
    assert sorted(summaries) == ["0", "1"], describe
    for rank, summary in summaries.items():
        assert re.match(r"\d+ passed", summary), f"rank {rank}: {summary}\n{describe}"
        assert not re.search(r"failed|error", summary), f"rank {rank}: {summary}\n{describe}"


@pytest.mark.timeout(300)
def test_test_sbatch_passes_the_mpi_tests_on_two_ranks(slurm: Cluster, tmp_path):
    job_id = slurm.submit(SLURM_DIR / "test.sbatch", *ONE_NODE,
                          log=tmp_path / "test-%j.out", cwd=ROOT)
    job = slurm.wait(job_id, limit=270)
    slurm.assert_completed(job)
    _assert_two_ranks_passed(job.output(), job.describe())


@pytest.mark.timeout(180)
def test_rendered_script_is_accepted_by_sbatch_and_runs(slurm: Cluster, tmp_path):
    script = tmp_path / "rendered.sbatch"
    subprocess.run(
        [sys.executable, "-m", "mpidl", "sbatch", "test", "--profile", "generic-cpu",
         "--nodes", "1", "--ntasks", "2", "--time", "00:05:00", "-J", "rendered",
         "-o", str(script), "--", "tests/mpi/test_comm.py"],
        check=True, cwd=ROOT, env=slurm.env, timeout=60)
    # No overrides: the rendered directives alone must fit this one-node cluster.
    job_id = slurm.submit(script, log=tmp_path / "rendered-%j.out", cwd=ROOT)
    job = slurm.wait(job_id, limit=150)
    slurm.assert_completed(job)
    assert job.fields.get("JobName") == "rendered", job.describe()
    assert job.fields.get("TimeLimit") == "00:05:00", job.describe()
    _assert_two_ranks_passed(job.output(), job.describe())
