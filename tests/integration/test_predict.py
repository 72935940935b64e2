"""`mpidl eval` and `mpidl predict` end to end, at 1 and 2 ranks, on a text run and a
dense run: predict answers for the test split's rows exactly as eval counted them, and
needs no dataset; eval needs only the test split.

The comparison is honest: the same rows go through both paths, eval through the test
split's shards and its exact evaluation, predict through its own input reading
(text tokenised again from the raw lines, or rows from an array file), splitting and
gathering; the confusion matrix counted from predict's labels must equal eval's.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import h5py
import numpy
import pytest

from mpidl.data import ShardedDataset, write_shards, write_text_shards
from mpidl.data.synthetic import generate_reviews
from mpidl.testing import tolerance
from mpidl.testing.launch import launch_env, mpiexec, run

pytestmark = [pytest.mark.timeout(300)]

MPIDL = [sys.executable, "-m", "mpidl"]
REVIEWS = ("negative", "positive")


def mpidl(ranks, *args, stdin=None, timeout=120):
    """``mpidl ARGS`` on ``ranks`` ranks (0: a plain process, fed ``stdin``)."""
    if ranks == 0:
        return run([*MPIDL, *args], timeout, launch_env(), input=stdin)
    return mpiexec(ranks, [*MPIDL, *args], timeout=timeout)


def predict_from_stdin(ranks, run_dir, text_file, *args):
    """``mpidl predict RUN_DIR`` with ``text_file`` as its standard input, at 1 rank (a
    plain process) or under mpiexec. There rank 0's standard input is the file itself:
    Open MPI 5's launcher does not forward its own (PRRTE #2373)."""
    if ranks == 1:
        with open(text_file, encoding="utf-8") as f:
            return mpidl(0, "predict", run_dir, *args, stdin=f.read())
    shell = 'exec "$0" -m mpidl predict "$@" < "$TEXT"'
    return mpiexec(ranks, ["sh", "-c", shell, sys.executable, run_dir, *args], timeout=120,
                   env={"TEXT": text_file})


def ok(result):
    assert result.returncode == 0, result.output
    return result.stdout


def evaluated(ranks, run_dir, *args):
    return json.loads(ok(mpidl(ranks, "eval", run_dir, "--json", *args)))


def predictions(stdout):
    """``[(label, probability, {label: probability})]`` of ``--json`` output, checking
    that the lines come in input order."""
    rows = [json.loads(line) for line in stdout.splitlines()]
    assert [r["index"] for r in rows] == list(range(len(rows)))
    return [(r["label"], r["probability"], r["probabilities"]) for r in rows]


def confusion(true, labels, names):
    out = numpy.zeros((len(names), len(names)), dtype=numpy.int64)
    numpy.add.at(out, (numpy.asarray(true), [names.index(label) for label in labels]), 1)
    return out.tolist()


def assert_same_predictions(a, b):
    """Two ranks' counts may sum the model's arithmetic in another order: labels equal,
    probabilities equal up to float32 rounding."""
    assert [p[0] for p in a] == [p[0] for p in b]
    rtol, atol = tolerance("float32")
    numpy.testing.assert_allclose([p[1] for p in a], [p[1] for p in b], rtol=rtol * 10,
                                  atol=atol * 10)


# -- a text run: the generated reviews ------------------------------------------------------

@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A bag-of-words run on 3000 generated reviews; the raw test texts and labels."""
    root = tmp_path_factory.mktemp("text")
    train_texts, train_labels, test_texts, test_labels = generate_reviews(3000, 1000, seed=3)
    data, run_dir = str(root / "data"), str(root / "run")
    write_text_shards(data, train_texts, [REVIEWS[i] for i in train_labels],
                      test_texts=test_texts, test_labels=[REVIEWS[i] for i in test_labels],
                      vocab_size=2000, length=64, classes=REVIEWS)
    ok(mpidl(2, "train", f"--data={data}", "--epochs=1", "--lr=1e-2", "--progress=never",
             f"--run-dir={run_dir}"))
    text_file = str(root / "test.txt")
    with open(text_file, "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in test_texts))
    return run_dir, data, text_file, list(test_labels)


def test_eval_scores_the_run_as_its_training_did(text_run):
    run_dir = text_run[0]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        trained = [r for r in map(json.loads, f) if r["kind"] == "eval"][-1]
    for ranks in (1, 2):
        scores = evaluated(ranks, run_dir)
        for key in ("test_accuracy", "macro_f1", "majority_accuracy", "recall"):
            assert scores[key] == pytest.approx(trained[key], abs=1e-12), key
        assert scores["classes"] == list(REVIEWS)
        assert numpy.trace(scores["confusion"]) == round(scores["test_accuracy"] * 1000)
    shown = ok(mpidl(2, "eval", run_dir))
    assert "majority-class accuracy: " in shown and "macro-F1: " in shown
    assert "true \\ predicted  negative  positive  recall" in shown


@pytest.mark.parametrize("ranks", [1, 2])
def test_predict_on_text_from_stdin_matches_eval(text_run, ranks):
    run_dir, _, text_file, true = text_run
    scores = evaluated(2, run_dir)
    got = predictions(ok(predict_from_stdin(ranks, run_dir, text_file, "--json", "--batch=64")))
    assert len(got) == len(true)
    assert confusion(true, [g[0] for g in got], list(REVIEWS)) == scores["confusion"]
    for label, probability, every in got[:20]:
        assert every[label] == probability == max(every.values())
        assert sum(every.values()) == pytest.approx(1.0, abs=1e-6)


def test_predict_prints_a_label_and_a_probability_per_line(text_run):
    run_dir = text_run[0]
    lines = ok(mpidl(0, "predict", run_dir, stdin="What a wonderful stay!\nrude staff"))
    labels = [line.split("\t")[0] for line in lines.splitlines()]
    assert len(labels) == 2 and set(labels) <= set(REVIEWS)
    assert all(0.5 <= float(line.split("\t")[1]) <= 1 for line in lines.splitlines())
    # No input and blank lines are refused: tests/integration/test_bad_inputs.py


def test_predict_needs_no_dataset_and_names_what_an_old_run_lacks(text_run, tmp_path):
    run_dir, data, text_file, _ = text_run
    before = predictions(ok(mpidl(2, "predict", run_dir, text_file, "--json")))
    aside = str(tmp_path / "moved")
    shutil.move(data, aside)
    try:
        after = predictions(ok(mpidl(2, "predict", run_dir, text_file, "--json")))
        assert_same_predictions(after, before)
        gone = mpidl(2, "eval", run_dir)  # eval needs the test split
        assert gone.returncode == 2 and gone.stderr.count("mpidl eval: error:") == 1
        assert os.path.join(data, "test") in gone.stderr
        # A run from before dataset.json: the dataset named in config.toml, or what to do.
        old = str(tmp_path / "old-run")
        shutil.copytree(run_dir, old)
        os.remove(os.path.join(old, "dataset.json"))
        missing = mpidl(2, "predict", old, text_file)
        assert missing.returncode == 2, missing.output
        assert missing.stderr.count("mpidl predict: error:") == 1
        assert f"{old} has no dataset.json" in missing.stderr
        assert "pass --data=DIR" in missing.stderr
        fallback = predictions(ok(mpidl(1, "predict", old, text_file, "--json",
                                        f"--data={aside}")))
        assert_same_predictions(fallback, before)
    finally:
        shutil.move(aside, data)


# -- a dense run: feature rows of 20 features, 4 classes ------------------------------------

@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """An MLP run on 1600 rows of 20 noisy features in 4 unequal classes, sharded with
    `mpidl shard --from-npz`; the test split's rows in an .npz (float64, cast on reading)
    and an .h5 file (under another name), and their labels."""
    root = tmp_path_factory.mktemp("dense")
    rng = numpy.random.default_rng(7)
    centers = rng.normal(0, 1, (4, 20))
    y = rng.choice(4, size=1600, p=[0.4, 0.3, 0.2, 0.1])
    x = (centers[y] + rng.normal(0, 1.6, (1600, 20))).astype(numpy.float32)
    npz, data, run_dir = str(root / "all.npz"), str(root / "data"), str(root / "run")
    numpy.savez(npz, x=x, y=y)
    ok(mpidl(1, "shard", "--from-npz", npz, "--test-fraction", "0.25", data))
    ok(mpidl(2, "train", "--task=custom", f"--data={data}", "--model=mlp",
             "--model.sizes=[20,32,4]", "--epochs=2", "--global-batch=32", "--progress=never",
             f"--run-dir={run_dir}"))
    test = ShardedDataset(os.path.join(data, "test"))
    ids = numpy.arange(len(test))
    rows, labels = test.read("x", ids), test.read("y", ids)
    numpy.savez(str(root / "rows.npz"), x=rows.astype(numpy.float64))
    with h5py.File(str(root / "rows.h5"), "w") as f:
        f["features"] = rows
    return run_dir, data, str(root), labels


def test_eval_of_a_dense_run_is_the_same_at_1_and_2_ranks(dense_run):
    run_dir = dense_run[0]
    one, two = evaluated(1, run_dir), evaluated(2, run_dir)
    assert one["confusion"] == two["confusion"] and one["test_samples"] == 400
    assert 0.5 < one["test_accuracy"] < 1.0  # an informative comparison: some mistakes
    assert one["majority_accuracy"] == pytest.approx(
        max(numpy.bincount(dense_run[3])) / 400)
    assert one["classes"] == ["0", "1", "2", "3"]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("rows", ["rows.npz", "rows.h5"])
def test_predict_on_an_array_file_matches_eval(dense_run, ranks, rows):
    run_dir, _, root, true = dense_run
    scores = evaluated(2, run_dir)
    # The input after the options, as users write it too.
    got = predictions(ok(mpidl(ranks, "predict", run_dir, "--json", "--batch=48",
                               os.path.join(root, rows))))
    assert confusion(true, [g[0] for g in got], scores["classes"]) == scores["confusion"]


def test_eval_needs_only_the_test_split(dense_run, tmp_path):
    run_dir, data, _, _ = dense_run
    expected = evaluated(2, run_dir)
    aside = str(tmp_path / "train")
    shutil.move(os.path.join(data, "train"), aside)  # a missing train split
    try:
        assert evaluated(2, run_dir) == expected
        old = str(tmp_path / "old-run")  # a run from before dataset.json: the test split alone
        shutil.copytree(run_dir, old)
        os.remove(os.path.join(old, "dataset.json"))
        # At 1 rank the float32 loss sums its batches in another order than at 2 (BLAS
        # kernels differ by machine: equal on some, 4e-8 apart on others); the rest is exact.
        alone = evaluated(1, old)
        assert alone.pop("test_loss") == pytest.approx(expected["test_loss"], rel=1e-6)
        assert alone == {**{k: v for k, v in expected.items() if k != "test_loss"},
                         "checkpoint": expected["checkpoint"].replace(run_dir, old)}
    finally:
        shutil.move(aside, os.path.join(data, "train"))
    # An empty train split beside the same test rows.
    test = ShardedDataset(os.path.join(data, "test"))
    ids = numpy.arange(len(test))
    empty = str(tmp_path / "empty")
    write_shards(empty, {"x": numpy.zeros((0, 20), numpy.float32),
                         "y": numpy.zeros(0, numpy.int64)},
                 test_arrays={"x": test.read("x", ids), "y": test.read("y", ids)})
    assert evaluated(1, run_dir, f"--data={empty}")["confusion"] == expected["confusion"]


def test_rows_of_the_wrong_width_or_no_file_are_one_error_on_every_rank(dense_run, tmp_path):
    run_dir = dense_run[0]
    narrow = str(tmp_path / "narrow.npz")
    numpy.savez(narrow, x=numpy.zeros((3, 19), numpy.float32))
    for path, message in [(narrow, "array 'x' has rows of shape [19], but the run's model "
                                   "reads rows of shape [20] (float32)"),
                          (str(tmp_path / "none.h5"), "none.h5: no such file")]:
        result = mpidl(2, "predict", run_dir, path)
        assert result.returncode == 2, result.output
        assert result.stderr.count("mpidl predict: error:") == 1 and message in result.stderr
        assert "Traceback" not in result.stderr
    lines = str(tmp_path / "lines.txt")
    with open(lines, "w") as f:
        f.write("text for a model of feature rows\n")
    text = mpidl(2, "predict", run_dir, lines)
    assert text.returncode == 2 and text.stderr.count("mpidl predict: error:") == 1
    assert "the dataset has no vocabulary (its inputs 'x' are float32[20])" in text.stderr
    unreadable = mpidl(1, "predict", run_dir, str(tmp_path / "nothing.txt"))
    assert unreadable.returncode == 2 and "nothing.txt: cannot be read" in unreadable.stderr
