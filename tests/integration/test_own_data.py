"""A user's own data trains well with `mpidl train --data DIR [--model NAME]` and nothing else.

The path a new user takes, end to end on real ranks: 3,000 real review sentences (UCI
"Sentiment Labelled Sentences", tests/data) written to a `review,sentiment` CSV, then
`mpidl shard --from-csv`, then `mpidl train` with the bag of words and with the
transformer, no model options; and a dense array dataset whose width is not 784 and
whose classes are not 10, with the mlp; a real table whose columns are in different
units (the UCI wine data) from a numeric CSV, with the mlp. The accuracy bars sit below
what these models reach here (measured; see each test), far above chance.
"""
from __future__ import annotations

import csv
import json
import os
import sys

import numpy
import pytest

from mpidl.testing.datasets import write_test_rows
from mpidl.testing.launch import mpiexec

pytestmark = [pytest.mark.timeout(600)]


def _evals(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval"]


@pytest.fixture(scope="module")
def reviews(tmp_path_factory, sentiment_sentences):
    """The 3,000 real sentences as `review,sentiment`, sharded with the defaults."""
    root = tmp_path_factory.mktemp("reviews")
    path = root / "reviews.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["review", "sentiment"])
        for name in ("imdb", "amazon", "yelp"):
            for line in (sentiment_sentences / f"{name}.tsv").read_text().splitlines():
                text, label = line.rsplit("\t", 1)
                out.writerow([text, "positive" if label == "1" else "negative"])
    data = str(root / "data")
    shard = mpiexec(1, [sys.executable, "-m", "mpidl", "shard", "--from-csv", str(path),
                        "--text-col", "review", "--label-col", "sentiment", data], timeout=120)
    assert shard.returncode == 0, shard.output
    return data, shard


def _train(data, run, *args, n=2):
    return mpiexec(n, [sys.executable, "-m", "mpidl", "train", f"--data={data}",
                       f"--run-dir={run}", "--progress=never", *args], timeout=420)


# Measured here (2 ranks, the defaults otherwise), test accuracy over the 300 held-out
# sentences; chance is 0.5 (balanced classes): bow 0.80-0.81 after 10 epochs (seeds 0-2);
# the transformer 0.737-0.777 after 5 (seeds 0-4; 0.76-0.82 after 10, seeds 0-2), which
# takes half the time of 10 (its 10 epochs were the suite's longest test, 73-87 s).
# Before padding was left out, bow stayed at 0.46-0.54.
@pytest.mark.parametrize("model,bar,epochs", [("bow", 0.74, 10), ("transformer", 0.70, 5)])
def test_real_review_sentences_train_well_with_no_model_options(reviews, tmp_path, model, bar,
                                                                 epochs):
    data, _ = reviews
    run = str(tmp_path / "run")
    result = _train(data, run, f"--model={model}", f"--epochs={epochs}")
    assert result.returncode == 0, result.output
    accuracy = _evals(run)[-1]["test_accuracy"]
    assert accuracy >= bar, (model, accuracy, result.stdout[-2000:])


def _dense(tmp_path, features=64, classes=7, rows=2100):
    rng = numpy.random.default_rng(5)
    centers = rng.standard_normal((classes, features)).astype(numpy.float32)
    y = rng.integers(0, classes, rows)
    x = (centers[y] + 0.9 * rng.standard_normal((rows, features))).astype(numpy.float32)
    path = tmp_path / "arrays.npz"
    numpy.savez(path, x=x, y=y)
    data = str(tmp_path / "data")
    done = mpiexec(1, [sys.executable, "-m", "mpidl", "shard", "--from-npz", str(path), data],
                   timeout=120)
    assert done.returncode == 0, done.output
    return data


def test_a_dense_dataset_of_64_features_and_7_classes_trains_with_the_plain_mlp(tmp_path):
    data = _dense(tmp_path)
    run = str(tmp_path / "run")
    result = _train(data, run, "--model=mlp", "--epochs=3")
    assert result.returncode == 0, result.output
    assert _evals(run)[-1]["test_accuracy"] >= 0.9  # measured: 0.99 (separable clusters)


# The UCI wine table (178 real wines, 13 measurements from 0.13 to 1,680: hue about 1,
# proline about 1,000; 3 cultivars), shipped inside scikit-learn, as a user's CSV.
# Measured here (2 ranks, the defaults: 3 epochs): 0.94 test accuracy with the columns
# standardised (one error in 18 held-out wines; a standardised logistic regression gets
# 1.0), 0.22-0.28 raw at 3-10 epochs (--model.standardize=false): the proline column
# swamps the others.
def test_a_real_table_with_columns_in_different_units_trains_with_the_mlp(tmp_path):
    datasets = pytest.importorskip("sklearn.datasets")
    wine = datasets.load_wine()
    names = [n.replace("/", "_") for n in wine.feature_names]
    path = tmp_path / "wine.csv"
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*names, "cultivar"])
        for row, t in zip(wine.data, wine.target):
            out.writerow([f"{v:g}" for v in row] + [wine.target_names[t]])
    data = str(tmp_path / "data")
    shard = mpiexec(1, [sys.executable, "-m", "mpidl", "shard", "--from-csv", str(path),
                        "--feature-cols", ",".join(names), "--label-col", "cultivar", data],
                    timeout=120)
    assert shard.returncode == 0, shard.output
    scaled, raw = str(tmp_path / "scaled"), str(tmp_path / "raw")
    # 3 epochs, not the data's choice (100 epochs on 142 rows; docs/data.md): raw columns
    # catch up with enough steps, and the contrast is the point here
    result = _train(data, scaled, "--model=mlp", "--epochs=3")
    assert result.returncode == 0, result.output
    accuracy = _evals(scaled)[-1]["test_accuracy"]
    assert accuracy >= 0.85, result.output
    result = _train(data, raw, "--model=mlp", "--model.standardize=false", "--epochs=3")
    assert result.returncode == 0, result.output
    assert _evals(raw)[-1]["test_accuracy"] <= 0.7 < accuracy
    # the checkpoint carries the train split's scale: new raw rows are scaled with it
    rows = tmp_path / "rows.npz"
    test, ids = write_test_rows(data, rows)
    done = mpiexec(1, [sys.executable, "-m", "mpidl", "predict", scaled, str(rows), "--json"],
                   timeout=120)
    assert done.returncode == 0, done.output
    labels = [json.loads(line)["label"] for line in done.stdout.splitlines()]
    truth = [test.class_name(int(k)) for k in test.read("y", ids)]
    assert numpy.mean([a == b for a, b in zip(labels, truth)]) == pytest.approx(accuracy)


@pytest.mark.parametrize("option,message", [
    ("--model.sizes=[784,1024,10]", "--model.sizes=[784, 1024, 10] contradicts the data"),
    ("--model.sizes=[64,32,10]", "has 7 classes, not 10"),
])
def test_a_model_option_that_contradicts_the_data_is_a_configuration_error(tmp_path, option,
                                                                           message):
    data = _dense(tmp_path, rows=200)
    result = _train(data, str(tmp_path / "run"), "--model=mlp", option)
    assert result.returncode == 2, result.output
    assert result.stderr.count(message) == 1, result.stderr


def test_a_text_model_option_that_contradicts_the_data_names_both_values(reviews, tmp_path):
    data, _ = reviews
    result = _train(data, str(tmp_path / "run"), "--model=bow", "--model.vocab=100")
    assert result.returncode == 2, result.output
    assert "--model.vocab=100 contradicts the data" in result.stderr
    assert "a vocabulary of" in result.stderr


def test_the_wrong_kind_of_model_for_the_data_says_which_to_use(tmp_path):
    data = _dense(tmp_path, rows=200)
    result = _train(data, str(tmp_path / "run"), "--model=bow")
    assert result.returncode == 2, result.output
    assert "model 'bow' reads token ids" in result.stderr and "--model=mlp" in result.stderr


def test_training_warns_when_one_class_dominates_with_the_accuracy_of_guessing_it(tmp_path):
    rng = numpy.random.default_rng(1)
    y = (rng.random(400) < 0.1).astype(numpy.int64)  # 90% class 0
    x = rng.standard_normal((400, 8)).astype(numpy.float32) + y[:, None]
    path = tmp_path / "skewed.npz"
    numpy.savez(path, x=x, y=y)
    data = str(tmp_path / "data")
    assert mpiexec(1, [sys.executable, "-m", "mpidl", "shard", "--from-npz", str(path), data],
                   timeout=120).returncode == 0
    result = _train(data, str(tmp_path / "run"), "--model=mlp", "--epochs=1")
    assert result.returncode == 0, result.output
    assert result.stdout.count("warning: one class dominates the training data: '0' is 89%") == 1
    assert "always guessing it scores 0.89" in result.stdout
