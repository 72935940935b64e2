"""`mpidl shard --from-h5` reads only bytes stored in the input file: external storage,
external links and virtual datasets with sources in other files are refused, by name."""

from __future__ import annotations

import h5py
import numpy
import pytest

from mpidl.data import DataError, ShardedDataset
from mpidl.data.command import main as shard_main
from mpidl.data.sources import load_h5

SECRET = b"private bytes of another local file!" * 4  # 144 bytes


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.bin"
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def other_h5(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["data"] = numpy.frombuffer(SECRET, numpy.uint8)
    return path


def crafted(tmp_path, build):
    """An input file with a normal ``y`` and an ``x`` made by ``build(file)``."""
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        f["y"] = numpy.arange(len(SECRET)) % 2
        build(f)
    return str(path)


def refused(path, match):
    with pytest.raises(DataError, match=match) as info:
        load_h5(path)
    return str(info.value)


def test_a_dataset_with_external_storage_is_refused(tmp_path, secret):
    path = crafted(tmp_path, lambda f: f.create_dataset(
        "x", shape=(len(SECRET),), dtype="u1", external=[(str(secret), 0, len(SECRET))]))
    message = refused(path, "dataset '/x' keeps its bytes in other file")
    assert path in message and str(secret) in message


def test_an_external_link_is_refused(tmp_path, other_h5):
    def build(f):
        f["x"] = h5py.ExternalLink(str(other_h5), "/data")

    message = refused(crafted(tmp_path, build), "'/x' is an external link")
    assert str(other_h5) in message


def test_an_external_link_to_a_split_group_is_refused(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = numpy.frombuffer(SECRET, numpy.uint8)
        f["y"] = numpy.arange(len(SECRET)) % 2

    def build(f):
        f["train"] = h5py.ExternalLink(str(other), "/")
        f.create_group("test")

    refused(crafted(tmp_path, build), "'/train' is an external link")


def test_a_soft_link_through_an_external_link_is_refused(tmp_path, other_h5):
    def build(f):
        f["outside"] = h5py.ExternalLink(str(other_h5), "/")
        f["x"] = h5py.SoftLink("/outside/data")

    refused(crafted(tmp_path, build), "'/x'.* another file")


def test_a_virtual_dataset_with_sources_in_another_file_is_refused(tmp_path, other_h5):
    def build(f):
        layout = h5py.VirtualLayout((len(SECRET),), numpy.uint8)
        layout[:] = h5py.VirtualSource(str(other_h5), "data", (len(SECRET),))
        f.create_virtual_dataset("x", layout)

    message = refused(crafted(tmp_path, build), "virtual dataset '/x' maps data from")
    assert str(other_h5) in message


def test_a_virtual_dataset_of_the_same_file_is_read(tmp_path):
    def build(f):
        f["parts/a"] = numpy.arange(100, dtype=numpy.uint8)
        f["parts/b"] = numpy.arange(100, 144, dtype=numpy.uint8)
        layout = h5py.VirtualLayout((len(SECRET),), numpy.uint8)
        layout[:100] = h5py.VirtualSource(".", "parts/a", (100,))
        layout[100:] = h5py.VirtualSource(".", "parts/b", (44,))
        f.create_virtual_dataset("x", layout)

    arrays = load_h5(crafted(tmp_path, build))["train"]
    numpy.testing.assert_array_equal(arrays["x"], numpy.arange(144) % 256)


def test_a_virtual_dataset_over_external_storage_in_the_same_file_is_refused(tmp_path, secret):
    def build(f):
        f.create_dataset("hidden", shape=(len(SECRET),), dtype="u1",
                         external=[(str(secret), 0, len(SECRET))])
        layout = h5py.VirtualLayout((len(SECRET),), numpy.uint8)
        layout[:] = h5py.VirtualSource(".", "hidden", (len(SECRET),))
        f.create_virtual_dataset("x", layout)

    refused(crafted(tmp_path, build), "dataset '/hidden' keeps its bytes in other file")


def test_the_cli_copies_no_outside_bytes_and_exits_2(tmp_path, secret, capsys):
    path = crafted(tmp_path, lambda f: f.create_dataset(
        "x", shape=(len(SECRET),), dtype="u1", external=[(str(secret), 0, len(SECRET))]))
    assert shard_main(["--from-h5", path, str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "keeps its bytes in other file" in err and "--from-h5" not in err  # predict too
    assert not (tmp_path / "d" / "train" / "manifest.json").exists()


def test_plain_datasets_still_shard(tmp_path):
    path = crafted(tmp_path, lambda f: f.create_dataset("x", data=numpy.ones((144, 2))))
    assert shard_main(["--from-h5", path, "--test-fraction", "0", str(tmp_path / "d")]) == 0
    assert len(ShardedDataset(str(tmp_path / "d" / "train"))) == 144
