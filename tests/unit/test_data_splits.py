"""Train and test splits of one dataset agree: features, dtypes, shapes, vocabulary and
classes. A test split that disagrees is refused, naming the split and the field."""

from __future__ import annotations

import shutil

import numpy
import pytest

from mpidl.data import DataError, ShardedDataset, write_shards, write_text_shards
from mpidl.data.command import main as shard_main
from mpidl.data.splits import check_splits_agree
from mpidl.testing.datasets import edit_manifest

TEXTS = ["good film", "bad film", "good plot", "bad acting", "a good one", "a bad one"] * 3
LABELS = ["pos", "neg", "pos", "neg", "pos", "neg"] * 3


def text_dataset(path, texts=TEXTS, labels=LABELS, **kw):
    write_text_shards(str(path), texts, labels, test_fraction=0.25, length=4, **kw)
    return path


def with_test_split_of(data, other):
    """``data`` with its test split replaced by ``other``'s (written on its own)."""
    shutil.rmtree(data / "test", ignore_errors=True)
    shutil.copytree(other / "test", data / "test")
    return data


def agreement_error(data):
    train, test = (ShardedDataset(str(data / s)) for s in ("train", "test"))
    with pytest.raises(DataError) as info:
        check_splits_agree({train.path: train.manifest, test.path: test.manifest})
    return str(info.value)


def test_splits_written_together_agree(tmp_path):
    data = text_dataset(tmp_path / "d")
    train, test = (ShardedDataset(str(data / s)) for s in ("train", "test"))
    check_splits_agree({train.path: train.manifest, test.path: test.manifest})
    assert shard_main(["--verify", str(data)]) == 0


def test_a_test_split_with_another_vocabulary_names_the_first_differing_word(tmp_path):
    data = text_dataset(tmp_path / "d")
    other = text_dataset(tmp_path / "o", [t.replace("good", "fine") for t in TEXTS])
    message = agreement_error(with_test_split_of(data, other))
    vocab = ShardedDataset(str(data / "train")).vocab
    at = vocab.index("good")
    assert f"{data / 'test'}: vocabulary differs from {data / 'train'}'s" in message
    assert f"first difference at id {at}: 'fine' vs 'good'" in message
    assert "re-shard both splits together with `mpidl shard`" in message


def test_a_test_split_declaring_3_classes_against_2_is_refused(tmp_path):
    x = numpy.zeros((8, 2), numpy.float32)
    write_shards(tmp_path / "d", {"x": x, "y": numpy.arange(8) % 2},
                 test_arrays={"x": x[:3], "y": numpy.array([0, 1, 0])})
    edit_manifest(tmp_path / "d" / "test", lambda m: m["labels"].update(num_classes=3))
    message = agreement_error(tmp_path / "d")
    assert f"{tmp_path / 'd' / 'test'}: 3 classes, {tmp_path / 'd' / 'train'} has 2" in message


def test_class_names_in_another_order_are_refused(tmp_path):
    data = text_dataset(tmp_path / "d", classes=["neg", "pos"])
    other = text_dataset(tmp_path / "o", classes=["pos", "neg"])
    message = agreement_error(with_test_split_of(data, other))
    assert "class names ['pos', 'neg'] differ from" in message and "['neg', 'pos']" in message


@pytest.mark.parametrize("test_arrays, expected", [
    ({"x": numpy.zeros((3, 2), numpy.float64)}, "feature 'x' has dtype <f8, "),
    ({"x": numpy.zeros((3, 5), numpy.float32)}, "feature 'x' has per-sample shape (5,), "),
    ({"x": numpy.zeros((3, 2), numpy.float32), "z": numpy.zeros(3)},
     "features ['x', 'y', 'z'] differ from "),
])
def test_features_of_another_name_dtype_or_shape_are_refused(tmp_path, test_arrays, expected):
    x = numpy.zeros((8, 2), numpy.float32)
    write_shards(tmp_path / "d", {"x": x, "y": numpy.arange(8) % 2})
    test_arrays = {**test_arrays, "y": numpy.array([0, 1, 0])}
    write_shards(tmp_path / "o", test_arrays, test_arrays=test_arrays, num_classes=2)
    message = agreement_error(with_test_split_of(tmp_path / "d", tmp_path / "o"))
    assert f"{tmp_path / 'd' / 'test'}: {expected}" in message


def test_verify_names_the_split_that_disagrees(tmp_path, capsys):
    data = text_dataset(tmp_path / "d")
    other = text_dataset(tmp_path / "o", [t.replace("good", "fine") for t in TEXTS])
    with_test_split_of(data, other)
    assert shard_main(["--verify", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"{data / 'test'}: vocabulary differs from {data / 'train'}'s" in err, err
