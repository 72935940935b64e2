"""Text datasets name their padding token id (``metadata["pad_id"]``), so that models
leave padding out; ``ShardedDataset.pad_id`` also answers for text datasets written
before, and None for arrays."""

from __future__ import annotations

import numpy
import pytest

from mpidl.data import DataError, ShardedDataset, write_shards, write_text_shards
from mpidl.data.splits import check_splits_agree
from mpidl.testing.datasets import edit_manifest


def test_text_manifests_name_their_padding_id(tmp_path):
    write_text_shards(str(tmp_path / "d"), ["good film", "bad"] * 4, ["p", "n"] * 4,
                      test_fraction=0.25)
    for split in ("train", "test"):
        ds = ShardedDataset(str(tmp_path / "d" / split))
        assert ds.metadata["pad_id"] == 0 and ds.pad_id == 0 and ds.vocab[0] == "<pad>"


def test_an_old_text_dataset_without_pad_id_pads_with_id_0(tmp_path):
    write_text_shards(str(tmp_path / "d"), ["good film", "bad"] * 4, ["p", "n"] * 4,
                      test_fraction=0.25)
    for split in ("train", "test"):
        edit_manifest(tmp_path / "d" / split, lambda m: m["metadata"].pop("pad_id"))
    train, test = (ShardedDataset(str(tmp_path / "d" / s)) for s in ("train", "test"))
    assert "pad_id" not in train.metadata and train.pad_id == 0
    check_splits_agree({train.path: train.manifest, test.path: test.manifest})


def test_an_array_dataset_has_no_padding_id(tmp_path):
    write_shards(str(tmp_path / "d"), {"x": numpy.zeros((4, 2)), "y": numpy.arange(4) % 2})
    assert ShardedDataset(str(tmp_path / "d" / "train")).pad_id is None


@pytest.mark.parametrize("bad", ["0", 5000, -1, True])
def test_a_pad_id_that_is_not_a_token_id_is_refused(tmp_path, bad):
    write_text_shards(str(tmp_path / "d"), ["good film"] * 4, ["p", "n"] * 2)
    edit_manifest(tmp_path / "d" / "train", lambda m: m["metadata"].update(pad_id=bad))
    with pytest.raises(DataError, match=f"metadata pad_id {bad!r} is not a token id in "
                                        r"\[0, 4\)"):
        ShardedDataset(str(tmp_path / "d" / "train"))


def test_splits_with_different_padding_ids_disagree(tmp_path):
    write_text_shards(str(tmp_path / "d"), ["good film", "bad"] * 4, ["p", "n"] * 4,
                      test_fraction=0.25)
    edit_manifest(tmp_path / "d" / "test", lambda m: m["metadata"].update(pad_id=1))
    train, test = (ShardedDataset(str(tmp_path / "d" / s)) for s in ("train", "test"))
    with pytest.raises(DataError, match="padding token id 1 differs from .*train's 0"):
        check_splits_agree({train.path: train.manifest, test.path: test.manifest})
