"""A dataset's description without its shards: written, read back, and encoding text
exactly as the writer did."""
from __future__ import annotations

import json
import os
import shutil

import numpy
import pytest

from mpidl.data import DataError, ShardedDataset, write_shards, write_text_shards
from mpidl.data.description import read_description, write_description

TEXTS = ["This movie isn't GOOD!!<br />", "A great, great film.", "bad", "Never again?",
         "great acting; bad plot", "an unseen word zyzzyva"]
LABELS = ["neg", "pos", "neg", "neg", "pos", "pos"]


@pytest.fixture
def text_split(tmp_path):
    write_text_shards(str(tmp_path / "data"), TEXTS, LABELS, vocab_size=8, length=5,
                      shuffle=False)
    return ShardedDataset(str(tmp_path / "data" / "train"))


def test_the_description_reads_back_as_the_dataset_describes_itself(text_split, tmp_path):
    path = str(tmp_path / "dataset.json")
    write_description(path, text_split.manifest, text_split.path)
    shutil.rmtree(tmp_path / "data")  # a description needs no shard
    d = read_description(path)
    assert d.features == text_split.features
    assert (d.vocab, d.classes, d.num_classes) == (text_split.vocab, ["neg", "pos"], 2)
    assert d.metadata == text_split.metadata and d.pad_id == 0
    assert d.class_name(1) == "pos" and d.class_name(5) == "5"
    saved = json.load(open(path))
    assert "shards" not in saved and saved["described"]["num_samples"] == len(TEXTS)


def test_texts_encode_as_the_writer_encoded_them(text_split, tmp_path):
    path = str(tmp_path / "dataset.json")
    write_description(path, text_split.manifest, text_split.path)
    stored = text_split.read("x", numpy.arange(len(TEXTS)))
    encoded = read_description(path).encode_texts(TEXTS)
    numpy.testing.assert_array_equal(encoded, stored)
    assert encoded.dtype == text_split.features["x"].dtype


def test_another_tokenizer_is_refused_by_name(text_split, tmp_path):
    path = str(tmp_path / "dataset.json")
    write_description(path, text_split.manifest, text_split.path)
    data = json.load(open(path))
    data["metadata"]["tokenizer"]["version"] = 99
    json.dump(data, open(path, "w"))
    with pytest.raises(DataError, match=r"dataset.json: the dataset's texts were tokenised by "
                                        r"'mpidl.words' version 99"):
        read_description(path).encode_texts(["hello"])


def test_rows_of_features_cannot_be_encoded_from_text(tmp_path):
    write_shards(str(tmp_path / "d"), {"x": numpy.zeros((4, 3), numpy.float32),
                                       "y": numpy.array([0, 1, 0, 1])})
    ds = ShardedDataset(str(tmp_path / "d" / "train"))
    assert ds.pad_id is None and ds.class_name(1) == "1"
    with pytest.raises(DataError, match=r"no vocabulary \(its inputs 'x' are float32\[3\]\)"):
        ds.encode_texts(["hello"])


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a readable dataset description"),
    ("[1, 2]", "not a dataset description"),
    ('{"format": "mpidl.dataset", "format_version": 1, "dataset_id": "a", "features": {}}',
     "'features' must be a non-empty object"),
])
def test_a_damaged_description_is_named(tmp_path, content, message):
    path = tmp_path / "dataset.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message) as raised:
        read_description(str(path))
    assert str(path) in str(raised.value)


def test_a_missing_description_is_named(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_description(os.path.join(tmp_path, "dataset.json"))
