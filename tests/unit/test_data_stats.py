"""What `mpidl shard` says the data is: the automatic text length and its cuts, class
counts, token-length percentiles, the unknown-token rate and the value range of array
features, printed and stored in each split's manifest."""

from __future__ import annotations

import csv

import numpy
import pytest

from mpidl.data import ShardedDataset, read_manifest, write_shards, write_text_shards
from mpidl.data.command import main as shard_main
from mpidl.data.stats import class_counts, feature_stats, majority
from mpidl.data.text import choose_length
from mpidl.testing.datasets import edit_manifest


def words(n, tag="w"):
    return " ".join(f"{tag}{i % 7}" for i in range(n))


def text_tree(root, train_lengths, test_lengths):
    """``root/{train,test}/{pos,neg}/NNN.txt``: one text of each length, alternating class."""
    for split, lengths in (("train", train_lengths), ("test", test_lengths)):
        for i, n in enumerate(lengths):
            d = root / split / ("pos", "neg")[i % 2]
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{i:04d}.txt").write_text(words(n), encoding="utf-8")
    return root


def shard(capsys, *args):
    rc = shard_main([str(a) for a in args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


# Most texts 5-10 tokens, a few of 1000: 198 of the 200 training texts (99%) have at
# most 10 tokens, so the length follows them: 10 rounded up to a multiple of 8.
SHORT = [5 + i % 6 for i in range(198)]
TRAIN = SHORT[:100] + [1000] + SHORT[100:] + [1000]
TEST = [5 + i % 6 for i in range(45)] + [16, 17, 1000, 999, 40]  # 4 longer than 16


def test_auto_length_follows_the_bulk_of_a_skewed_distribution(tmp_path, capsys):
    out = shard(capsys, "--from-folder", text_tree(tmp_path / "in", TRAIN, TEST), tmp_path / "d")
    assert out.splitlines()[0] == ("length 16 (auto: 99% of the 200 training texts have <= 10 "
                                   "tokens; 2 train and 4 test texts cut)")
    train, test = (ShardedDataset(str(tmp_path / "d" / s)) for s in ("train", "test"))
    assert train.features["x"].shape == test.features["x"].shape == (16,)
    assert train.metadata["length"] == 16
    assert train.metadata["length_choice"] == {
        "chosen": "auto", "percentile": 99, "percentile_tokens": 10, "auto": 16,
        "multiple": 8, "min": 8, "cap": 512}
    tokens = train.metadata["stats"]["tokens"]
    assert (tokens["p50"], tokens["p99"], tokens["max"], tokens["cut"]) == (8, 10, 1000, 2)
    assert test.metadata["stats"]["tokens"]["cut"] == 4
    assert "16 cut" not in out and "2 cut to 16" in out and "4 cut to 16" in out


def test_auto_length_is_capped_when_the_long_texts_are_more_than_one_percent(tmp_path, capsys):
    train = SHORT[:190] + [1000] * 10  # 5% long: the 99th percentile is 1000 tokens
    out = shard(capsys, "--from-folder", text_tree(tmp_path / "in", train, [600, 512, 5]),
                tmp_path / "d")
    assert out.splitlines()[0] == (
        "length 512 (auto: 99% of the 200 training texts have <= 1000 tokens, more than the "
        "cap 512; 10 train and 1 test texts cut)")
    assert read_manifest(str(tmp_path / "d" / "train")).features["x"].shape == (512,)


@pytest.mark.parametrize("lengths, want", [
    ([1, 2, 3] * 40, 8),              # at least 8
    ([0] * 50, 8),                    # texts with no token at all
    ([], 8),                          # no texts
    ([24] * 99 + [25], 24),           # a multiple of 8 stays
    ([17] * 100, 24),                 # rounded up
    (list(range(1, 101)), 104),       # 99 of 100 have <= 99 tokens
    ([5000] * 100, 512),              # capped
])
def test_choose_length_rounds_up_to_a_multiple_of_8_between_8_and_512(lengths, want):
    assert choose_length(lengths) == want


def test_length_n_forces_the_length_and_reports_the_cuts(tmp_path, capsys):
    out = shard(capsys, "--from-folder", text_tree(tmp_path / "in", TRAIN, TEST), "--length",
                "9", tmp_path / "d")
    # longer than 9: the 33 training texts of 10 tokens and the 2 of 1000; in the test
    # split, 7 of 10 tokens and the 5 long ones
    assert out.splitlines()[0] == (
        "length 9 (given; 99% of the 200 training texts have <= 10 tokens, so auto would "
        "choose 16; 35 train and 12 test texts cut)")
    m = read_manifest(str(tmp_path / "d" / "train"))
    assert m.features["x"].shape == (9,) and m.metadata["length_choice"]["chosen"] == "given"
    assert m.metadata["stats"]["tokens"]["cut"] == 35


def test_the_api_keeps_a_given_length_as_the_reviews_corpus_passes_it(tmp_path):
    m = write_text_shards(str(tmp_path / "d"), ["good film"] * 4, ["a", "b"] * 2, length=128)
    assert m["train"].features["x"].shape == (128,)
    assert m["train"].metadata["length_choice"]["chosen"] == "given"


@pytest.mark.parametrize("bad", ["0", "-3", "abc", "12.5"])
def test_a_bad_length_is_a_usage_error(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as info:
        shard_main(["--from-folder", str(tmp_path), "--length", bad, str(tmp_path / "d")])
    assert info.value.code == 2 and "neither 'auto' nor a number" in capsys.readouterr().err
    with pytest.raises(ValueError, match="must be 'auto'"):
        write_text_shards(str(tmp_path / "e"), ["a"], ["x"], length=0)


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


def test_real_sentences_get_a_length_from_their_texts(tmp_path, capsys, sentiment_sentences):
    out = shard(capsys, "--from-csv", sentiment_sentences / "imdb.tsv", "--no-header",
                "--text-col", "0", "--label-col", "1", tmp_path / "d")
    m = read_manifest(str(tmp_path / "d" / "train"))
    length, tokens = m.metadata["length"], m.metadata["stats"]["tokens"]
    assert length % 8 == 0 and tokens["p99"] <= length < tokens["p99"] + 8 <= 80, out
    assert tokens["cut"] <= 9 and m.metadata["stats"]["classes"].keys() == {"0", "1"}
