"""slurm/bench.sbatch on the local Slurm: the collective sweep, and the scaling study.

The two-task job also runs the optional `mpidl train` step (MPIDL_BENCH_TRAIN) for a
few steps of a tiny model; its run directory lands in the test's temporary folder.

    PYTHONPATH=. .venv/bin/python -m pytest -p no:cacheprovider -q \
        tests/slurm/test_bench_template.py
"""
from __future__ import annotations

import json
import re

import pytest

from slurmci import SLURM_DIR, Cluster

pytestmark = pytest.mark.slurm

SMALL = ["--max-bytes", "4096", "--iters", "5", "--warmup", "2", "--windows", "2"]
SIZES = [4, 16, 64, 256, 1024, 4096]
TRAIN = ("--steps=3 --data.num-train=1000 --data.num-test=200 --data.vocab-size=500 "
         "--data.seq-len=32 --data.cache-dir=/tmp/mpidl-slurm-ci-corpus --progress=never "
         "--model=transformer --model.dim=16 --model.layers=1 --model.heads=2 --model.ffn=32")


def _submit(slurm: Cluster, tmp_path, ntasks: int, args, env=None):
    # Submitted from tmp_path: the job's runs/ folder goes there, not into the checkout.
    job_id = slurm.submit(SLURM_DIR / "bench.sbatch", "--nodes=1", f"--ntasks={ntasks}",
                          "--cpus-per-task=1", "--time=4", args=args,
                          log=tmp_path / "bench-%j.out", cwd=tmp_path, env=env)
    job = slurm.wait(job_id, limit=150)
    slurm.assert_completed(job)
    return job


@pytest.mark.timeout(180)
def test_bench_sbatch_on_two_tasks_prints_the_allreduce_table_once(slurm: Cluster, tmp_path):
    job = _submit(slurm, tmp_path, 2, SMALL, env={"MPIDL_BENCH_TRAIN": TRAIN})
    out, describe = job.output(), job.describe()
    bench_part, _, train_part = out.partition("=== train: 2 ranks on 1 node(s)")
    # One communicator of size 2 (two size-1 singletons would also exit 0).
    assert re.findall(r"^ranks: (\d+)$", bench_part, re.M) == ["2"], describe
    assert re.findall(r"^=== bench: (\d+) ranks on (\d+) node", out, re.M) == [("2", "1")]
    assert re.findall(r"^# hpc\.bench (\w+): (\d+) ranks", out, re.M) == [("allreduce", "2")]
    rows = re.findall(r"^\s+(\d+)\s+\d+\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\S+)\s+(\S+)$",
                      out, re.M)
    assert [int(r[0]) for r in rows] == SIZES, describe  # rank 0 alone prints
    assert all(float(busbw) > 0 for _, _, busbw in rows), describe
    assert len(re.findall(r"^# fit over 6 sizes, t = alpha \+ bytes / beta: alpha = ", out,
                          re.M)) == 1, describe
    # The optional training step ran on the same 2 ranks and reported its throughput.
    assert re.search(r"^ranks: +2$", train_part, re.M), describe
    assert re.search(r"^samples/s: +[\d.]+", train_part, re.M), describe
    job_dir = f"runs/{job.fields.get('JobName')}-{job.job_id}/train-2"
    assert (tmp_path / job_dir).is_dir(), describe


@pytest.mark.timeout(180)
def test_bench_sbatch_scaling_study_runs_each_rank_count(slurm: Cluster, tmp_path):
    job = _submit(slurm, tmp_path, 3, SMALL + ["--json", "--op", "allreduce,bcast"])
    out, describe = job.output(), job.describe()
    assert re.findall(r"^=== bench: (\d+) ranks", out, re.M) == ["2", "3"], describe
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rows = [(r["ranks"], r["op"], r["bytes"]) for r in records if "fit" not in r]
    assert rows == [(n, op, b) for n in (2, 3) for op in ("allreduce", "bcast")
                    for b in SIZES], describe
    fits = [(r["ranks"], r["op"]) for r in records if "fit" in r]
    assert fits == [(2, "allreduce"), (2, "bcast"), (3, "allreduce"), (3, "bcast")]
