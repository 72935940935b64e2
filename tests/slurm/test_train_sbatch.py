"""slurm/train_cpu.sbatch and slurm/preemptible.sbatch with `mpidl train` on the local Slurm.

- train_cpu at 2 tasks is one communicator of size 2 (``ranks: 2`` from `mpidl info`;
  a PMI mismatch would give two size-1 worlds that still exit 0) and trains to an
  accuracy.
- preemptible: SIGUSR1 mid-training (``scancel --signal=USR1``, what ``--signal=USR1@T``
  sends before the time limit) makes the training checkpoint and exit 75; the script
  requeues the job; the next attempt resumes, appending to the same log; the final
  parameters equal those of an uninterrupted run.

TRAIN_ARGS choose a small, quick task; ``MPIDL_SLURM_TRAIN_ARGS`` (shell words)
replaces them.

    PYTHONPATH=. .venv/bin/python -m pytest -p no:cacheprovider -q tests/slurm/test_train_sbatch.py
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import time
from pathlib import Path

import numpy as np
import pytest

from slurmci import SLURM_DIR, Cluster

pytestmark = pytest.mark.slurm

# A small reviews corpus and a tiny transformer: a few seconds per epoch on 2 tasks.
DEFAULT_TRAIN_ARGS = (
    "--data.num-train=6000 --data.num-test=2000 --data.vocab-size=2000 --data.seq-len=64 "
    "--data.cache-dir=/tmp/mpidl-slurm-ci-corpus --lr=1e-2 --log-every=1 --progress=never "
    "--model=transformer --model.dim=16 --model.layers=1 --model.heads=2 --model.ffn=32")
TRAIN_ARGS = shlex.split(os.environ.get("MPIDL_SLURM_TRAIN_ARGS", DEFAULT_TRAIN_ARGS))
# Long enough that the signal lands mid-training, after the first progress is written.
PREEMPT_EPOCHS = ["--epochs", "3"]
TWO_TASKS = ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10")
EX_TEMPFAIL = 75


def _has_train() -> bool:
    try:
        return importlib.util.find_spec("mpidl.train.command") is not None
    except ModuleNotFoundError:
        return False


needs_train = pytest.mark.skipif(not _has_train(), reason="needs mpidl train (issue 6)")


def _progress(run_dir: Path) -> bool:
    """The training has written a checkpoint or a metrics line (so its handlers are set)."""
    if not run_dir.is_dir():
        return False
    return any(p.stat().st_size > 0 for pattern in ("**/*.h5", "**/*.jsonl")
               for p in run_dir.glob(pattern))


def _final_parameters(run_dir: Path) -> dict[str, np.ndarray]:
    """The parameters of the run dir's newest checkpoint (a sharded one's index:
    assembled)."""
    import re

    from mpidl.train.checkpoint import load_checkpoint

    checkpoints = [p for p in run_dir.glob("**/*.h5")
                   if re.fullmatch(r"checkpoint-\d+\.h5", p.name)]
    assert checkpoints, f"no checkpoint under {run_dir}"
    newest = max(checkpoints, key=lambda p: p.stat().st_mtime_ns)
    return dict(load_checkpoint(str(newest), "model").model)


@needs_train
@pytest.mark.timeout(300)
def test_train_cpu_is_one_two_rank_communicator_and_reports_accuracy(slurm: Cluster, tmp_path):
    run_dir = tmp_path / "run"
    job_id = slurm.submit(SLURM_DIR / "train_cpu.sbatch", *TWO_TASKS,
                          args=[*TRAIN_ARGS, "--epochs", "1", f"--run-dir={run_dir}"],
                          log=tmp_path / "train-%j.out", cwd=tmp_path)
    job = slurm.wait(job_id, limit=240)
    slurm.assert_completed(job)
    output = job.output()
    assert re.findall(r"^ranks: (\d+)$", output, re.M) == ["2"], job.describe()
    assert re.search(r"acc(uracy)?\W+\d*\.\d+", output, re.I), job.describe()


@needs_train
@pytest.mark.timeout(420)
def test_preemptible_checkpoints_requeues_and_resumes_to_the_uninterrupted_result(
        slurm: Cluster, tmp_path):
    args = [*TRAIN_ARGS, *PREEMPT_EPOCHS]
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "preempted"
    # The uninterrupted run shares the node (4 CPUs advertised) with the preempted one.
    reference = slurm.submit(SLURM_DIR / "train_cpu.sbatch", *TWO_TASKS,
                             args=[*args, f"--run-dir={reference_dir}"],
                             log=tmp_path / "reference-%j.out", cwd=tmp_path)
    job_id = slurm.submit(SLURM_DIR / "preemptible.sbatch", *TWO_TASKS,
                          args=[*args, f"--run-dir={run_dir}"],
                          log=tmp_path / "preempted-%j.out", cwd=tmp_path)
    signalled: list[float] = []

    def signal_once_training_runs(state: tuple[str, str]) -> None:
        if not signalled and state[0] == "RUNNING" and _progress(run_dir):
            # Only the job steps (the ranks) get it, as with --signal=USR1@T.
            slurm.run("scancel", "--signal=USR1", job_id)
            signalled.append(time.monotonic())

    job = slurm.wait(job_id, limit=360, on_poll=signal_once_training_runs)
    ref = slurm.wait(reference, limit=120)
    slurm.assert_completed(ref)
    assert signalled, f"the training ended before it wrote progress to {run_dir}\n" \
                      f"{job.describe()}"
    slurm.assert_completed(job)
    output = job.output()
    assert job.restarts >= 1, f"the job was not requeued\n{job.describe()}"
    # Both attempts in one log (--open-mode=append), each one communicator of size 2.
    assert re.findall(r"^=== job \d+ \(\S+\) attempt (\d+)", output, re.M)[:2] == ["1", "2"], \
        job.describe()
    assert re.findall(r"^ranks: (\d+)$", output, re.M)[:2] == ["2", "2"], job.describe()
    assert f"exited {EX_TEMPFAIL}; requeueing job {job_id}" in output, job.describe()

    expected, actual = _final_parameters(reference_dir), _final_parameters(run_dir)
    assert sorted(actual) == sorted(expected)
    # Resume is bit-for-bit (same ranks, same order of reductions): exact equality.
    differ = {name: float(np.max(np.abs(actual[name] - expected[name])))
              for name in expected if not np.array_equal(actual[name], expected[name])}
    assert not differ, f"parameters differ after preemption and resume (max |diff|): {differ}"
