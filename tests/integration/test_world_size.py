"""A launch MPI did not join is refused at start-up (exit 2), a real one still runs.

`srun` without the PMI plugin its MPI speaks starts N processes that each see a world
of size 1 (Open MPI 5 under `srun --mpi=pmi2`). Here a plain process gets the variables
of such an srun step, which is exactly what one of those tasks sees: Slurm's step
variables and a singleton MPI.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpc.cuda_aware import singleton_environ
from mpidl.testing.launch import launch_env, mpiexec

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--epochs=1", "--data.num-train=512", "--data.num-test=128", "--data.vocab-size=300",
        "--data.seq-len=16", "--progress=never"]


def srun_task(rank: int) -> dict[str, str]:
    """Task ``rank`` of `srun -n 2` on one node, as Slurm's step variables describe it."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_TASKS_PER_NODE": "2",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURMD_NODENAME": "node01"}


def plain(cmd, cwd, extra=None):
    """``cmd`` as one process without any launcher's variables, plus ``extra``."""
    environ = {k: v for k, v in singleton_environ(launch_env()).items()
               if not k.startswith(("SLURM_", "PALS_", "PBS_"))}
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, environ.get("PYTHONPATH")]))
    environ.update(extra or {})
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=environ,
                          timeout=180)


def train_cmd(run_dir, cache):
    return [sys.executable, "-m", "mpidl", "train", *TINY, f"--data.cache-dir={cache}",
            f"--run-dir={run_dir}"]


def test_train_in_an_srun_step_mpi_did_not_join_exits_2_before_any_work(tmp_path, cache):
    pytest.importorskip("mpi4py")
    run = tmp_path / "run"
    first = plain(train_cmd(run, cache), tmp_path, srun_task(0))
    assert first.returncode == 2, first.stdout + first.stderr
    assert first.stdout == ""  # not even the config: refused before any work
    assert first.stderr.startswith("mpidl train: error: the launcher (slurm) started 2 "
                                   "processes, but MPI ("), first.stderr
    assert "sees a world of size 1 in each" in first.stderr
    assert "srun --mpi=" in first.stderr and "Traceback" not in first.stderr
    assert not run.exists() and os.listdir(tmp_path) == []
    # The other task refuses too, silently: one message per job, from the launcher's rank 0.
    second = plain(train_cmd(run, cache), tmp_path, srun_task(1))
    assert (second.returncode, second.stdout, second.stderr) == (2, "", "")


def test_bench_in_an_srun_step_mpi_did_not_join_exits_2(tmp_path):
    pytest.importorskip("mpi4py")
    out = plain([sys.executable, "-m", "hpc.bench", "--max-bytes", "64"], tmp_path,
                srun_task(0))
    assert out.returncode == 2, out.stdout + out.stderr
    assert "hpc.bench: error: the launcher (slurm) started 2 processes" in out.stderr
    assert "bytes" not in out.stdout  # no sweep of a collective of one


def test_train_on_two_real_ranks_and_alone_still_runs(tmp_path, cache):
    launched = mpiexec(2, train_cmd(tmp_path / "two", cache), timeout=200, cwd=ROOT,
                       env={"PYTHONPATH": ROOT})
    assert launched.returncode == 0, launched.output
    assert "mpidl train on 2 ranks" in launched.stdout
    alone = plain(train_cmd(tmp_path / "one", cache), ROOT)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "mpidl train on 1 rank," in alone.stdout and "error" not in alone.stderr
