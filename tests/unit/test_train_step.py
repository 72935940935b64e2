"""The training step on its own (:class:`mpidl.train.step.TrainStep`): built from a
config without a Trainer or a run directory, it is the step ``mpidl train`` runs, bit
for bit, and the one ``mpidl plan`` times."""
from __future__ import annotations

import ast
import os
import pathlib
import signal

import numpy
import pytest

from mpidl.comm import SingleCommunicator
from mpidl.train import latest_checkpoint, load_checkpoint
from mpidl.train.build import build_run
from mpidl.train.command import main
from mpidl.train.config import load_config
from mpidl.train.log import Logger
from mpidl.train.step import TrainStep
from mpidl.train.task import prepare_data

# As tests/unit/test_train_resume.py: 120 reviews in batches of 16, 8 steps.
TINY = ["--data.num-train=120", "--data.num-test=20", "--data.vocab-size=200",
        "--data.seq-len=16", "--model.dim=8", "--model.hidden=8", "--global-batch=16",
        "--epochs=1", "--progress=never",
        "--keep-freed-memory=false"]  # mallopt is process-wide: not in the test process


@pytest.fixture
def args(tmp_path):
    return [*TINY, f"--data.cache-dir={tmp_path / 'cache'}"]


def test_the_step_called_on_its_own_trains_as_mpidl_train_does(args, tmp_path):
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert main([*args, f"--run-dir={tmp_path / 'run'}"]) == 0
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    trained = load_checkpoint(latest_checkpoint(os.path.join(tmp_path, "run", "checkpoints")))

    config = load_config(None, args)
    comm = SingleCommunicator()
    run = build_run(config, comm, prepare_data(config, comm, Logger()))
    step = TrainStep(run)
    done = 0
    try:
        run.loader.set_epoch(0)
        for x, y, n in run.loader:
            result = step(x, y, n, done)
            assert result.counted > 0 and not result.preempted
            done += 1
    finally:
        run.close()
    assert done == trained.step == run.total_steps == 8
    params = dict(run.model.named_parameters())
    assert params.keys() == trained.model.keys()
    for name, p in params.items():  # the same batches, the same step: the same numbers
        assert numpy.array_equal(p.data, trained.model[name]), name


def test_the_planner_times_the_public_step_and_builds_no_trainer():
    source = (pathlib.Path(__file__).resolve().parents[2] / "mpidl" / "plan.py").read_text()
    imported = {node.module for node in ast.walk(ast.parse(source))
                if isinstance(node, ast.ImportFrom)}
    assert "mpidl.train.step" in imported
    assert "mpidl.train.trainer" not in imported


def test_mpidl_train_with_microbatches_trains_as_one_batch_does(args, tmp_path):
    """`mpidl train --microbatches=3` (16 samples a step: 6 + 5 + 5) ends within float32
    rounding of the one-microbatch run (~1 s each)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    models = {}
    try:
        for m in (1, 3):
            run_dir = tmp_path / f"run{m}"
            assert main([*args, f"--microbatches={m}", f"--run-dir={run_dir}"]) == 0
            models[m] = load_checkpoint(latest_checkpoint(str(run_dir / "checkpoints"))).model
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert models[1].keys() == models[3].keys()
    for name in models[1]:
        assert numpy.allclose(models[3][name], models[1][name], rtol=1e-4, atol=1e-6), name
    # Not bit for bit: the flag reached the step (ignored, the runs would be identical).
    assert any(not numpy.array_equal(models[3][n], models[1][n]) for n in models[1])
