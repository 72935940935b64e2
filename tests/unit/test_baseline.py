"""`--baseline auto|off`: which runs end with the linear model's score, and its line."""
import os

import numpy
import pytest

from mpidl.comm import world
from mpidl.data import ShardedDataset
from mpidl.data.writer import write_shards
from mpidl.train import baseline
from mpidl.train.config import load_config


def _split(tmp_path, rows, width):
    out = str(tmp_path / "data")
    write_shards(out, {"x": numpy.zeros((rows, width), numpy.float32),
                       "y": numpy.arange(rows) % 2})
    return ShardedDataset(os.path.join(out, "train"))


@pytest.mark.parametrize("argv, rows, width, expected", [
    (["--model=mlp"], 100, 8, True),
    (["--model=mlp", "--data="], 100, 8, False),     # a generated corpus: mpidl's demo
    (["--model=mlp", "--baseline=off"], 100, 8, False),
    (["--model=linear"], 100, 8, False),            # it is the baseline already
    (["--model=mlp"], baseline.MAX_VALUES // 8, 8, True),
    (["--model=mlp"], baseline.MAX_VALUES // 8 + 1, 8, False),  # too large to be quick
])
def test_the_baseline_runs_where_asked_on_small_data_only(tmp_path, argv, rows, width,
                                                          expected):
    config = load_config(None, ["--data=DIR", *argv])
    assert baseline.wanted(config, _split(tmp_path, rows, width)) is expected


def test_the_baseline_trains_the_linear_model_at_its_rate_for_enough_steps():
    config = load_config(None, ["--model=bow", "--model.dim=8", "--epochs=1", "--steps=3",
                                "--precision=bf16", "--zero=2", "--global-batch=32"])
    linear = baseline.baseline_config(config, 2700)
    assert (linear.model.name, linear.model.kwargs, linear.lr) == ("linear", {}, 1e-2)
    # 2,700 rows in batches of 32: 85 steps an epoch, 5 epochs reach 400 steps
    assert (linear.epochs, linear.steps, linear.global_batch) == (5, None, 32)
    assert (linear.precision, linear.zero) == ("fp32", 0)
    assert (config.model.name, config.epochs) == ("bow", 1)  # the run's own is untouched


def test_the_baseline_fits_on_a_small_table_and_says_so(tmp_path):
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((300, 4)).astype(numpy.float32)
    y = (x @ [1.0, -2.0, 0.5, 0.0] > 0).astype(numpy.int64)  # linearly separable
    out = str(tmp_path / "data")
    write_shards(out, {"x": x, "y": y}, test_fraction=0.2)
    config = load_config(None, [f"--data={out}", "--model=mlp"])
    scores, epochs, seconds = baseline.fit_baseline(config, world(), out, 240)
    assert epochs == 100 and scores.record["test_accuracy"] >= 0.95
    line = baseline.describe("mlp", False, scores, 0.9, epochs, seconds, "test_accuracy",
                             "test accuracy")
    assert line.startswith("baseline: linear model (logistic regression on features), "
                           "100 epochs in ")
    assert "(the mlp: 0.9000; --baseline=off skips this)" in line
