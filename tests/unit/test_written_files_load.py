"""Every file a writer makes, its own reader loads, for every dtype the writer can meet:
the checkpoint writers (single file, sharded parts and index, consolidated) and the
dataset writer. A bfloat16 tensor was written by the single-file writer as h5py's opaque
``|V2``, which no loader took back (#38): a consolidated bf16 checkpoint did not load."""
from __future__ import annotations

import numpy
import pytest

from mpidl.backend import bfloat16, dtype_name
from mpidl.parallel.holdings import Held, Key, runs_array
from mpidl.train import checkpoint as ckpt
from mpidl.train import checkpoint_file, consolidate, sharded
from mpidl.train.pieces import load as load_pieces

DTYPES = ["float64", "float32", "float16", "bfloat16", "int8", "uint8", "uint16", "int32",
          "int64", "bool"]
SHAPE = (5, 7)  # 35 elements: two parts of 17 and 18


def values(name):
    dtype = bfloat16() if name == "bfloat16" else numpy.dtype(name)
    raw = numpy.random.default_rng(3).normal(0, 40, SHAPE)
    if dtype.kind == "b":
        return raw > 0
    if dtype.kind in "iu":
        info = numpy.iinfo(dtype)
        return numpy.clip(raw, info.min, info.max).astype(dtype)
    return raw.astype(dtype)


def same(got, want):
    """Equal dtype, shape and bits (float16/bfloat16 compared bit for bit)."""
    got = numpy.asarray(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.tobytes() == want.tobytes()


def record(key, array, runs, got):
    """A record holding ``runs`` of ``array``'s flat elements, keeping what a load writes."""
    flat = array.reshape(-1)
    runs = runs_array(runs)
    mine = numpy.concatenate([flat[s:s + n] for s, n in runs])
    return Held(key, array.shape, array.dtype, runs, lambda: mine,
                lambda v: got.setdefault(key, v.copy()))


def loaded_records(path, key, array, runs):
    """The elements ``runs`` of tensor ``key``, loaded from ``path`` as a resume does."""
    got = {}
    with ckpt.open_source(ckpt.load_checkpoint(path, "none"), ["w"]) as source:
        load_pieces(source, [record(key, numpy.empty_like(array), runs, got)])
    flat = array.reshape(-1)
    return got[key], numpy.concatenate([flat[s:s + n] for s, n in runs_array(runs)])


def write_sharded(directory, array):
    """A format-3 checkpoint of step 1 whose tensor ``model:w`` is split over two parts
    (ranks 0 and 1), as two ZeRO ranks write it."""
    key = Key("model", "w")
    halves = {0: [(0, 17)], 1: [(17, 18)]}
    parts = {rank: sharded.write_part(str(directory / sharded.part_name(1, rank)), 1, rank,
                                      [record(key, array, runs, {})])
             for rank, runs in halves.items()}
    return sharded.write_index(str(directory), 1, parts,
                               {key: (array.shape, dtype_name(array.dtype))}, {},
                               meta={"order": ["w"], "buffers": [], "optimizer": None},
                               rng={}, sampler={}, config="", epoch=0, extra={})


@pytest.mark.parametrize("name", DTYPES)
def test_a_single_file_checkpoint_loads_every_dtype_it_writes(tmp_path, name):
    array = values(name)
    path = ckpt.save_checkpoint(tmp_path, 1, model={"w": array, "s": array[0, 0]},
                                optimizer={"state.0.exp_avg": array}, rng={}, sampler={})
    full = ckpt.load_checkpoint(path)
    same(full.model["w"], array)
    same(full.optimizer["state.0.exp_avg"], array)
    same(numpy.asarray(full.model["s"]), numpy.asarray(array[0, 0]))
    got, want = loaded_records(path, Key("model", "w"), array, [(3, 9), (30, 5)])
    same(got, want)


@pytest.mark.parametrize("name", DTYPES)
def test_a_sharded_checkpoint_and_its_consolidated_file_load_every_dtype(tmp_path, name):
    array = values(name)
    path = write_sharded(tmp_path, array)
    same(ckpt.load_checkpoint(path).model["w"], array)
    got, want = loaded_records(path, Key("model", "w"), array, [(10, 10)])  # both parts
    same(got, want)
    out = consolidate.consolidate(path, str(tmp_path / "out" / "full.h5"))
    same(ckpt.load_checkpoint(out).model["w"], array)
    same(ckpt.load_checkpoint(out, "model").model["w"], array)
    got, want = loaded_records(out, Key("model", "w"), array, [(0, 35)])
    same(got, want)


def test_a_bfloat16_tensor_is_stored_as_its_bits_and_named():
    array = values("bfloat16")
    data, name = checkpoint_file.stored(array)
    assert data.dtype == numpy.uint16 and name == "bfloat16"
    same(checkpoint_file.restored(data, name), array)
    for other in ("float16", "uint16", "float32"):  # stored as they are, never renamed
        a = values(other)
        assert checkpoint_file.stored(a) == (a, None)
        same(checkpoint_file.restored(a, None), a)


def test_a_bfloat16_written_as_opaque_v2_before_the_rule_still_loads(tmp_path):
    """Files of mpidl up to a8b384f hold bfloat16 as h5py's opaque |V2: the same bits."""
    import h5py

    array = values("bfloat16")
    path = ckpt.save_checkpoint(tmp_path, 1, model={"w": array}, optimizer={}, rng={},
                                sampler={})
    with h5py.File(path, "r+") as f:  # as the old writer left it
        crc = f["model/w"].attrs["__crc32__"]
        del f["model/w"]
        f["model"].create_dataset("w", data=array)
        f["model/w"].attrs["__crc32__"] = crc
        assert f["model/w"].dtype.str == "|V2"
    same(ckpt.load_checkpoint(path).model["w"], array)
    got, want = loaded_records(path, Key("model", "w"), array, [(0, 35)])
    same(got, want)


# -- the dataset writer ---------------------------------------------------------------------

@pytest.mark.parametrize("name", [d for d in DTYPES if d != "bfloat16"])
def test_a_dataset_loads_every_dtype_its_writer_takes(tmp_path, name):
    from mpidl.data import ShardedDataset
    from mpidl.data.writer import write_shards

    array = values(name)
    write_shards(str(tmp_path / "d"), {"x": array}, shuffle=False, labels=None,
                 rows_per_shard=2)
    ds = ShardedDataset(str(tmp_path / "d" / "train"))
    try:
        same(ds.read("x", numpy.arange(len(array))), array)
    finally:
        ds.close()


def test_the_dataset_writer_refuses_bfloat16_and_says_what_to_convert_it_to(tmp_path):
    from mpidl.data.format import DataError
    from mpidl.data.writer import write_shards

    with pytest.raises(DataError, match=r"feature 'x' has dtype bfloat16.*float32"):
        write_shards(str(tmp_path / "d"), {"x": values("bfloat16")})
    assert not (tmp_path / "d").exists() or not list((tmp_path / "d").iterdir())
