"""hpc.env and hpc.gpu inside a real job: srun's variables against MPI's own view.

The cluster advertises fake GPUs (``gres/gpu`` backed by ``/dev/null`` clones, see
cluster.sh), so Slurm sets ``CUDA_VISIBLE_DEVICES`` per task exactly as on a GPU node;
no CUDA is involved. The job sources ``slurm/env.sh`` and launches through its
``mpidl_srun``, as the templates do.

    PYTHONPATH=. .venv/bin/python -m pytest -p no:cacheprovider -q tests/slurm/test_env_gpu.py
"""
from __future__ import annotations

import json

import pytest

from slurmci import ROOT, SLURM_DIR, Cluster

pytestmark = pytest.mark.slurm

JOB = """#!/bin/bash
set -euo pipefail
# shellcheck source=/dev/null
source "{slurm_dir}/env.sh"
echo "=== step: all"          # every task sees the job's two GPUs
mpidl_srun "$MPIDL_PYTHON" tests/slurm/probe.py
echo "=== step: per-task"     # Slurm gives each task its own GPU
mpidl_srun --gpus-per-task=1 "$MPIDL_PYTHON" tests/slurm/probe.py
"""


def _fake_gpus(slurm: Cluster) -> int:
    node = slurm.run("scontrol", "-o", "show", "node").stdout
    for word in node.split():
        if word.startswith("Gres=gpu:"):
            return int(word.split(":")[-1].split("(")[0])
    return 0


def _steps(output: str) -> dict[str, list[dict]]:
    steps: dict[str, list[dict]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("=== step: "):
            current = steps.setdefault(line.split(": ", 1)[1], [])
        elif line.startswith("PROBE ") and current is not None:
            current.append(json.loads(line[len("PROBE "):]))
    return steps


@pytest.mark.timeout(120)
def test_env_and_gpu_binding_agree_with_mpi_inside_a_job(slurm: Cluster, tmp_path):
    if _fake_gpus(slurm) < 2:
        pytest.skip("the running cluster advertises fewer than 2 GPUs; restart it with "
                    "MPIDL_SLURM_CI_FAKE_GPUS=2 tests/slurm/cluster.sh")
    script = tmp_path / "probe.sbatch"
    script.write_text(JOB.format(slurm_dir=SLURM_DIR))
    job_id = slurm.submit(script, "--nodes=1", "--ntasks=2", "--cpus-per-task=2",
                          "--gres=gpu:2", "--time=5", log=tmp_path / "probe-%j.out", cwd=ROOT)
    job = slurm.wait(job_id, limit=90)
    slurm.assert_completed(job)
    steps = _steps(job.output())
    assert sorted(steps) == ["all", "per-task"], job.describe()

    for step, records in steps.items():
        where = f"step {step!r} of {job.describe()}"
        assert [r["mpi"]["rank"] for r in records] == [0, 1], where
        for r in records:
            detected, mpi, environ = r["detect"], r["mpi"], r["environ"]
            # What hpc.env read from srun's variables before MPI_Init is MPI's truth.
            for key in ("rank", "size", "local_rank", "local_size", "node_index", "nodes"):
                assert detected[key] == mpi[key], f"{key}: {detected} vs {mpi}\n{where}"
            assert (mpi["size"], mpi["local_size"], mpi["nodes"]) == (2, 2, 1), where
            assert detected["rank"] == int(environ["SLURM_PROCID"]), where
            assert detected["launcher"] == "slurm" and r["is_mpi_launch"], where
            assert detected["job_id"] == job_id, where
            assert detected["node"] == environ["SLURMD_NODENAME"], where
            # env.sh: one thread per CPU of the task.
            assert environ["OMP_NUM_THREADS"] == "2", where
            assert r["bind"] == r["device"] is not None, where
        # Each rank ends up on its own physical GPU, whichever way Slurm exposed them.
        physical = [r["visible"][r["device"]] for r in records]
        assert sorted(physical) == ["0", "1"], f"physical devices {physical}\n{where}"

    per_task = steps["per-task"]
    assert sorted(r["visible"] for r in per_task) == [["0"], ["1"]], job.describe()
    assert [r["device"] for r in per_task] == [0, 0], job.describe()
    assert all(r["visible"] == ["0", "1"] for r in steps["all"]), job.describe()
