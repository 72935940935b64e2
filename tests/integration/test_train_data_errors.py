"""A dataset `mpidl train` cannot use honestly is refused with one message naming the file
and the fix: splits that disagree, an absurd manifest, a shard holding a bad token id.

The path a user takes: `mpidl shard` a CSV, (someone edits or mixes the files), then
`mpiexec -n 2 mpidl train --data DIR`.
"""
from __future__ import annotations

import os
import shutil
import sys

import h5py
import pytest

from mpidl.testing.datasets import edit_manifest, resync_shard
from mpidl.testing.launch import mpiexec

pytestmark = [pytest.mark.timeout(300)]

WORDS = {"positive": ["good", "great", "fine", "lovely"], "negative": ["bad", "awful", "poor"]}


def write_csv(path, flip=False):
    """200 reviews of 6 words; ``flip`` swaps which words mean which class (and so the
    vocabulary's order)."""
    lines = ["review,sentiment"]
    for i in range(200):
        label = ("positive", "negative")[i % 2]
        words = WORDS[label if not flip else ("negative", "positive")[i % 2]]
        lines.append(" ".join(words[(i + k) % len(words)] for k in range(6)) + f",{label}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def shard(tmp_path, name, flip=False):
    data = str(tmp_path / name)
    result = mpiexec(1, [sys.executable, "-m", "mpidl", "shard", "--from-csv",
                         write_csv(tmp_path / f"{name}.csv", flip), "--text-col", "review",
                         "--label-col", "sentiment", "--length", "8", data], timeout=120)
    assert result.returncode == 0, result.output
    return data


def train(tmp_path, data):
    return mpiexec(2, [sys.executable, "-m", "mpidl", "train", f"--data={data}", "--epochs=1",
                       "--progress=never", f"--run-dir={tmp_path / 'run'}"], timeout=120)


def refused_once(result, *names):
    assert result.returncode == 2, result.output
    assert result.stderr.count("mpidl train: error:") == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for name in names:
        assert name in result.stderr, result.stderr


def test_a_test_split_with_another_vocabulary_is_refused_on_every_rank(tmp_path):
    data, other = shard(tmp_path, "data"), shard(tmp_path, "other", flip=True)
    shutil.rmtree(os.path.join(data, "test"))
    shutil.copytree(os.path.join(other, "test"), os.path.join(data, "test"))
    refused_once(train(tmp_path, data), f"{data}/test: vocabulary differs from {data}/train's",
                 "re-shard both splits together with `mpidl shard`")


def test_a_test_split_declaring_3_classes_against_2_is_refused(tmp_path):
    data = shard(tmp_path, "data")
    edit_manifest(os.path.join(data, "test"), lambda m: m["labels"].update(num_classes=3))
    refused_once(train(tmp_path, data), f"{data}/test: 3 classes, {data}/train has 2")


def test_an_absurd_num_classes_in_a_manifest_is_refused_before_any_allocation(tmp_path):
    data = shard(tmp_path, "data")
    for split in ("train", "test"):
        edit_manifest(os.path.join(data, split),
                      lambda m: m["labels"].update(num_classes=10**9))
    refused_once(train(tmp_path, data), f"{data}/train/manifest.json", "num_classes 1000000000")


def test_a_nul_byte_in_a_shard_name_is_a_data_error_naming_the_manifest(tmp_path):
    data = shard(tmp_path, "data")
    edit_manifest(os.path.join(data, "train"),
                  lambda m: m["shards"][0].update(file="shard-0\x000000.h5"))
    refused_once(train(tmp_path, data), f"{data}/train/manifest.json", "NUL")


def test_a_token_id_out_of_range_names_the_shard_split_value_and_limit(tmp_path):
    data = shard(tmp_path, "data")
    with h5py.File(os.path.join(data, "train", "shard-00000.h5"), "r+") as f:
        f["x"][5, 2] = 60000
    path = resync_shard(os.path.join(data, "train"), 0)
    # Token ids small enough to cache are checked at start-up, on every rank together.
    refused_once(train(tmp_path, data), f"{path}: token id 60000 at row 5 is outside [0, ",
                 "split 'train'", "rewrite the dataset with `mpidl shard`")
