"""Scientific workloads end to end on real ranks: real images with the cnn, regression
from CSV columns, and the generated cosmology task with the 3-D cnn."""
from __future__ import annotations

import csv
import json
import os
import sys

import numpy
import pytest

from mpidl.testing.datasets import write_test_rows
from mpidl.testing.launch import mpiexec

pytestmark = [pytest.mark.timeout(400)]


def shard(*args):
    done = mpiexec(1, [sys.executable, "-m", "mpidl", "shard", *args], timeout=120)
    assert done.returncode == 0, done.output
    return done


def train(run, *args, n=2):
    return mpiexec(n, [sys.executable, "-m", "mpidl", "train", *args, f"--run-dir={run}",
                       "--progress=never"], timeout=360)


def last_eval(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval"][-1]


def test_real_handwritten_digits_train_with_the_cnn_and_no_model_options(tmp_path):
    # 1,797 real 8x8 scans (UCI, shipped inside scikit-learn), one channel.
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    path = tmp_path / "digits.npz"
    numpy.savez(path, x=(digits.images / 16.0).astype(numpy.float32)[:, None], y=digits.target)
    data = str(tmp_path / "data")
    shard("--from-npz", str(path), data, "--test-fraction", "0.2")
    run = str(tmp_path / "run")
    result = train(run, f"--data={data}", "--model=cnn", "--epochs=5")
    assert result.returncode == 0, result.output
    # Measured here: 0.98-0.99 test accuracy (360 held-out digits; chance 0.1).
    assert last_eval(run)["test_accuracy"] >= 0.9


def test_a_regression_dataset_from_csv_columns_trains(tmp_path):
    rng = numpy.random.default_rng(3)
    x = rng.standard_normal((1200, 3))
    # targets in very different units: both must be learned (the loss is in standard units)
    y = numpy.stack([numpy.sin(2 * x[:, 0]) - x[:, 1], 1000 * x[:, 2] ** 2], axis=1) * (
        1 + 0.02 * rng.standard_normal((1200, 2)))
    path = tmp_path / "table.csv"
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["a", "b", "c", "t1", "t2"])
        out.writerows(numpy.concatenate([x, y], axis=1).round(6).tolist())
    data = str(tmp_path / "data")
    done = shard("--from-csv", str(path), "--feature-cols", "a,b,c", "--target-cols",
                 "t1,t2", data, "--test-fraction", "0.2")
    assert "y float32[2]" in done.stdout, done.stdout
    run = str(tmp_path / "run")
    result = train(run, f"--data={data}", "--model=mlp", "--epochs=10")
    assert result.returncode == 0, result.output
    record = last_eval(run)
    assert record["test_r2"] >= 0.9, record  # measured: 0.97-0.99
    assert len(record["test_r2_per_output"]) == 2 and "final test R²" in result.stdout
    # measured per target: 0.97 and 0.99; with the loss in the data's units the small
    # target got 0.77 (its share of the loss a millionth of the large one's)
    assert min(record["test_r2_per_output"]) >= 0.85, record
    # `mpidl eval` of the run scores it as the trainer did, at another rank count
    done = mpiexec(1, [sys.executable, "-m", "mpidl", "eval", run, "--json"], timeout=120)
    assert done.returncode == 0, done.output
    scored = json.loads(done.stdout)
    assert scored["test_r2"] == pytest.approx(record["test_r2"], rel=1e-6)
    assert scored["test_mse_per_output"] == pytest.approx(record["test_mse_per_output"],
                                                          rel=1e-6)
    # `mpidl predict` writes the values the evaluation scored: the test rows' squared
    # errors from its output are the eval record's MSE per target
    rows = tmp_path / "rows.npz"
    test, ids = write_test_rows(data, rows)
    done = mpiexec(2, [sys.executable, "-m", "mpidl", "predict", run, str(rows), "--json"],
                   timeout=120)
    assert done.returncode == 0, done.output
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["index"] for r in lines] == list(range(len(test)))
    assert all(r["targets"] == ["t1", "t2"] for r in lines)
    predicted = numpy.array([r["prediction"] for r in lines])
    mse = ((predicted - test.read("y", ids)) ** 2).mean(axis=0)
    assert mse.tolist() == pytest.approx(record["test_mse_per_output"], rel=1e-4)
    plain = mpiexec(1, [sys.executable, "-m", "mpidl", "predict", run, str(rows)], timeout=120)
    first = plain.stdout.splitlines()[0].split("\t")
    assert plain.returncode == 0 and len(first) == 2
    assert [float(v) for v in first] == pytest.approx(lines[0]["prediction"], rel=1e-5)


def test_a_csv_column_that_is_not_a_number_is_named(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("a,t\n1.5,2\nseven,3\n")
    done = mpiexec(1, [sys.executable, "-m", "mpidl", "shard", "--from-csv", str(path),
                       "--feature-cols", "a", "--target-cols", "t", str(tmp_path / "d")],
                   timeout=60)
    assert done.returncode != 0 and f"{path}:3: feature column 'a' holds 'seven'" in done.stderr


def test_the_cosmology_task_learns_the_spectra_of_gaussian_random_fields(tmp_path, cache):
    run = str(tmp_path / "run")
    result = train(run, "cosmo", f"--data.cache-dir={cache}", "--steps=120",
                   "--data.num-train=1600", "--data.num-test=320")
    assert result.returncode == 0, result.output
    record = last_eval(run)
    # Measured: R² 0.78-0.85 after 120 steps at 2 ranks here (seeds 0-2; 0.86 after the
    # preset's 6 epochs).
    assert record["test_r2"] >= 0.3, record


def test_batch_norm_running_statistics_travel_in_sharded_checkpoints(tmp_path):
    # A ZeRO checkpoint is every rank's pieces of the parameters; the model's buffers
    # (the cnn's running statistics) are not sharded and go in whole, so the checkpoint
    # of a ZeRO run equals the data-parallel run's, buffers included (float64), and
    # resumes, evaluates and predicts under any layout.
    rng = numpy.random.default_rng(5)
    y = numpy.arange(96) % 2
    x = (rng.standard_normal((96, 1, 8, 8)) + 3.0 * y[:, None, None, None]).astype(numpy.float32)
    numpy.savez(tmp_path / "img.npz", x=x, y=y)
    data = str(tmp_path / "data")
    shard("--from-npz", str(tmp_path / "img.npz"), data, "--test-fraction", "0.25")
    common = [f"--data={data}", "--model=cnn", "--model.dtype=float64", "--steps=6",
              "--global-batch=16"]
    runs = {zero: str(tmp_path / f"z{zero}") for zero in (0, 2)}
    for zero, run in runs.items():
        result = train(run, *common, f"--zero={zero}")
        assert result.returncode == 0, result.output
    from mpidl.train.checkpoint import load_checkpoint

    plain, sharded = (load_checkpoint(os.path.join(r, "checkpoints", "checkpoint-00000006.h5"))
                      for r in runs.values())
    assert set(sharded.model) == set(plain.model)
    assert any(name.endswith("running_mean") for name in plain.model)
    for name, value in plain.model.items():
        numpy.testing.assert_allclose(sharded.model[name], value, rtol=1e-9, atol=1e-12,
                                      err_msg=name)
    result = train(runs[2], *common[:-2], "--steps=8", "--global-batch=16", n=1)
    assert result.returncode == 0 and "resumed from" in result.output, result.output
    done = mpiexec(1, [sys.executable, "-m", "mpidl", "eval", runs[2], "--json"], timeout=120)
    assert done.returncode == 0, done.output
