"""What `mpidl shard` says the data is: class counts, token-length percentiles, the
unknown-token rate and the value range of array features, printed and stored in each
split's manifest."""

from __future__ import annotations

import csv

import numpy
import pytest

from mpidl.data import read_manifest, write_shards
from mpidl.data.command import main as shard_main
from mpidl.data.stats import class_counts, feature_stats, majority
from mpidl.testing.datasets import edit_manifest


def shard(capsys, *args):
    rc = shard_main([str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def test_csv_stats_count_classes_token_lengths_and_unknown_words(tmp_path, capsys):
    rows = [("good good film", "positive"), ("bad film", "negative"),
            ("good plot", "positive"), ("bad bad acting!", "negative"), ("good", "positive")]
    with open(tmp_path / "r.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("review", "sentiment"), *rows])
    out = shard(capsys, "--from-csv", tmp_path / "r.csv", "--text-col", "review",
                "--label-col", "sentiment", "--test-fraction", "0", "--min-freq", "2",
                "--length", "8", tmp_path / "d")
    m = read_manifest(str(tmp_path / "d" / "train"))
    stats = m.metadata["stats"]
    assert stats["samples"] == 5
    assert stats["classes"] == {"negative": 2, "positive": 3}
    # lengths 3, 2, 2, 4, 1; 'plot', 'acting', '!' are seen once: <unk> with --min-freq 2
    assert stats["tokens"] == {"p50": 2, "p90": 4, "p95": 4, "p99": 4, "max": 4, "mean": 2.4,
                               "empty": 0, "cut": 0, "stored": 12, "unknown": 3,
                               "unk_rate": 0.25}
    assert class_counts(m) == {"negative": 2, "positive": 3}
    assert majority(m) == ("positive", 0.6)
    assert "  classes: negative 2 (40.0%), positive 3 (60.0%)" in out
    assert ("  tokens per text: p50 2, p90 4, p99 4, max 4 (mean 2.4); 0 cut to 8; 25.0% of "
            "the stored tokens are <unk>") in out


def test_npz_stats_give_each_features_range_and_count_nan_and_inf(tmp_path, capsys):
    rng = numpy.random.default_rng(0)
    x = rng.normal(3.0, 2.0, size=(5000, 30)).astype(numpy.float32)  # > one 64 Ki block
    x[7, 2], x[9, 0], x[11, 5] = numpy.nan, numpy.inf, -numpy.inf
    y = numpy.array([0] * 4000 + [1] * 900 + [2] * 100)
    numpy.savez(tmp_path / "in.npz", x=x, y=y)
    out = shard(capsys, "--from-npz", tmp_path / "in.npz", "--test-fraction", "0",
                tmp_path / "d")
    m = read_manifest(str(tmp_path / "d" / "train"))
    stats = m.metadata["stats"]
    assert stats["classes"] == {"0": 4000, "1": 900, "2": 100} and "y" not in stats["features"]
    fx, finite = stats["features"]["x"], x[numpy.isfinite(x)].astype(numpy.float64)
    assert (fx["nan"], fx["inf"]) == (1, 2)
    assert (fx["min"], fx["max"]) == (float(finite.min()), float(finite.max()))
    assert fx["mean"] == pytest.approx(finite.mean(), rel=1e-12)
    assert fx["std"] == pytest.approx(finite.std(), rel=1e-12)
    assert majority(m) == ("0", 0.8)
    assert f"  x: min {finite.min():.6g}, max {finite.max():.6g}" in out
    assert "  warning: x holds 1 NaN and 2 infinite value(s)" in out


def test_feature_stats_of_integer_boolean_and_empty_features():
    assert feature_stats(numpy.array([[3, -2], [7, 0]], numpy.int16)) == {
        "min": -2, "max": 7, "mean": 2.0, "std": pytest.approx(11.5 ** 0.5), "nan": 0,
        "inf": 0}
    assert feature_stats(numpy.array([True, False, True, True]))["mean"] == 0.75
    assert feature_stats(numpy.full(3, numpy.nan)) == {
        "min": None, "max": None, "mean": None, "std": None, "nan": 3, "inf": 0}


def test_a_dataset_without_stats_or_labels_has_no_majority(tmp_path):
    write_shards(str(tmp_path / "d"), {"x": numpy.zeros((4, 2))}, labels=None)
    m = read_manifest(str(tmp_path / "d" / "train"))
    assert class_counts(m) is None and majority(m) is None
    write_shards(str(tmp_path / "e"), {"x": numpy.zeros((4, 2)), "y": numpy.arange(4) % 2})
    edit_manifest(tmp_path / "e" / "train", lambda m: m["metadata"].pop("stats"))
    assert majority(read_manifest(str(tmp_path / "e" / "train"))) is None
