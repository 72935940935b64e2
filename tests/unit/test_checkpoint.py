"""HDF5 checkpoints: exact round trips, atomic writes, damaged files, retention, resume."""
from __future__ import annotations

import os

import h5py
import numpy
import pytest

from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.optim import AdamW
from mpidl.train.checkpoint import (
    FORMAT_VERSION,
    READABLE_VERSIONS,
    CheckpointError,
    checkpoint_name,
    keep_last,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    set_aside_after,
)
from mpidl.train.config import Config, to_toml


def _save(directory, step, **kw):
    args = dict(model={"w": numpy.arange(3.0)}, optimizer={"step": step, "lr": 0.1},
                rng={}, sampler={"epoch": 0, "index": step})
    args.update(kw)
    return save_checkpoint(directory, step, **args)


def test_model_optimizer_and_metadata_round_trip_exactly(tmp_path, xp):
    gen = numpy.random.default_rng(0)
    model = {
        "embed.weight": xp.asarray(gen.standard_normal((5, 3)).astype(numpy.float32)),
        "layers.0.attn.qkv.bias": xp.asarray(gen.standard_normal(9)),
        "count": xp.asarray(numpy.int64(7)).reshape(()),          # a 0-d array
    }
    params = [Tensor(gen.standard_normal((4, 2)).astype(numpy.float32), requires_grad=True)
              for _ in range(2)]
    opt = AdamW(params, lr=0.01)
    for p in params:
        p.grad = numpy.ones_like(p.data)
    opt.step()
    config = to_toml(Config())
    path = save_checkpoint(tmp_path, 12, model=model, optimizer=opt.state_dict(), rng={},
                           sampler={"epoch": 1, "index": 640, "seed": 0}, config=config,
                           epoch=1, extra={"size": 2, "scale": numpy.float32(0.5), "note": None})
    assert os.path.basename(path) == checkpoint_name(12) == "checkpoint-00000012.h5"
    ckpt = load_checkpoint(path)
    assert ((ckpt.step, ckpt.epoch, ckpt.config, ckpt.format_version)
            == (12, 1, config, FORMAT_VERSION))
    assert list(ckpt.model) == list(model)                     # order kept, dotted names kept
    for name, value in model.items():
        assert ckpt.model[name].dtype == value.dtype
        numpy.testing.assert_array_equal(ckpt.model[name], as_numpy(value))
    assert ckpt.model["count"].shape == ()
    assert ckpt.sampler == {"epoch": 1, "index": 640, "seed": 0}
    assert ckpt.extra["size"] == 2 and ckpt.extra["note"] is None
    assert type(ckpt.extra["scale"]) is numpy.float32 and ckpt.extra["scale"] == 0.5

    fresh = AdamW([Tensor(numpy.zeros((4, 2), numpy.float32), requires_grad=True)
                   for _ in range(2)], lr=0.5)
    fresh.load_state_dict(ckpt.optimizer)
    assert fresh.step_count == opt.step_count and fresh.lr == opt.lr
    for old, new in zip(opt.state, fresh.state):
        assert old.keys() == new.keys()
        for key in old:
            numpy.testing.assert_array_equal(as_numpy(old[key]), as_numpy(new[key]))


def test_dotted_names_are_single_datasets_in_the_model_group(tmp_path):
    path = _save(tmp_path, 1, model={"blocks.0.ln.weight": numpy.ones(2)})
    with h5py.File(path, "r") as f:
        assert list(f["model"].keys()) == ["blocks.0.ln.weight"]
        assert isinstance(f["model"]["blocks.0.ln.weight"], h5py.Dataset)
        for group in ("model", "optimizer", "rng", "sampler"):
            assert group in f


def test_numpy_rng_states_round_trip_bit_for_bit(tmp_path):
    gen = numpy.random.default_rng(1234)
    gen.standard_normal(1001)                      # an odd count: has_uint32 state matters
    gen.integers(0, 10, size=3, dtype=numpy.uint32)
    legacy = numpy.random.RandomState(5)
    legacy.rand(7)
    rng = {"numpy": gen.bit_generator.state, "legacy": legacy.get_state(legacy=False)}
    ckpt = load_checkpoint(_save(tmp_path, 3, rng=rng))
    assert ckpt.rng["numpy"] == gen.bit_generator.state
    restored = numpy.random.default_rng()
    restored.bit_generator.state = ckpt.rng["numpy"]
    numpy.testing.assert_array_equal(restored.standard_normal(100), gen.standard_normal(100))
    numpy.testing.assert_array_equal(restored.integers(0, 2**32, 10, dtype=numpy.uint32),
                                     gen.integers(0, 2**32, 10, dtype=numpy.uint32))
    legacy2 = numpy.random.RandomState()
    legacy2.set_state(ckpt.rng["legacy"])
    numpy.testing.assert_array_equal(legacy2.rand(5), legacy.rand(5))


def test_write_is_atomic_and_leaves_no_temporary(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 1, model={"w": numpy.zeros(2)})     # same step: replaced
    assert sorted(os.listdir(tmp_path)) == [checkpoint_name(1)]
    numpy.testing.assert_array_equal(load_checkpoint(tmp_path / checkpoint_name(1)).model["w"],
                                     numpy.zeros(2))


def test_failed_write_removes_its_temporary_and_keeps_the_old_file(tmp_path):
    _save(tmp_path, 5)
    with pytest.raises(TypeError, match="optimizer/bad"):
        _save(tmp_path, 5, optimizer={"bad": object()})
    assert sorted(os.listdir(tmp_path)) == [checkpoint_name(5)]
    numpy.testing.assert_array_equal(load_checkpoint(tmp_path / checkpoint_name(5)).model["w"],
                                     numpy.arange(3.0))


def test_slash_in_a_name_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="model/'a/b'"):
        _save(tmp_path, 1, model={"a/b": numpy.ones(1)})


def test_latest_ignores_tmp_and_skips_truncated_files_with_a_warning(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    (tmp_path / (checkpoint_name(30) + ".tmp")).write_bytes(b"half written")
    assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, checkpoint_name(20))
    newest = tmp_path / checkpoint_name(20)
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 3])                 # truncated by a crash
    with pytest.warns(RuntimeWarning, match="checkpoint-00000020"):
        assert latest_checkpoint(tmp_path) == os.path.join(tmp_path, checkpoint_name(10))


def test_load_of_a_truncated_file_names_it(tmp_path):
    path = _save(tmp_path, 1)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="checkpoint-00000001.h5.*truncated, corrupt"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="nothing.h5"):
        load_checkpoint(tmp_path / "nothing.h5")


def test_load_of_another_format_version_names_file_and_versions(tmp_path):
    path = _save(tmp_path, 1)
    newer = max(READABLE_VERSIONS) + 1
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = newer
    with pytest.raises(CheckpointError, match=f"checkpoint-00000001.h5.*version {newer}"):
        load_checkpoint(path)


def test_keep_last_keeps_the_newest_k(tmp_path):
    for step in (5, 10, 15, 20):
        _save(tmp_path, step)
    (tmp_path / (checkpoint_name(25) + ".tmp")).write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    removed = keep_last(tmp_path, 2)
    assert len(removed) == 3
    assert sorted(os.listdir(tmp_path)) == [checkpoint_name(15), checkpoint_name(20), "notes.txt"]
    with pytest.raises(ValueError, match="k must be >= 1"):
        keep_last(tmp_path, 0)


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path):
    for step in (16, 32, 48):
        _save(tmp_path, step)
    assert set_aside_after(tmp_path, 48) is None  # nothing newer
    aside = set_aside_after(tmp_path, 16)
    assert os.path.dirname(aside) == str(tmp_path)
    assert os.path.basename(aside).startswith("abandoned-after-00000016-")
    assert sorted(os.listdir(aside)) == [checkpoint_name(32), checkpoint_name(48)]
    # The new branch's checkpoints are the latest, and the ones keep_last keeps.
    for step in (20, 25):
        _save(tmp_path, step)
    keep_last(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == str(tmp_path / checkpoint_name(25))
    assert load_checkpoint(os.path.join(aside, checkpoint_name(48))).step == 48


def test_resolve_resume(tmp_path):
    run = tmp_path / "run"
    assert resolve_resume("auto", run) is None
    assert resolve_resume(False, run) is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        resolve_resume(True, run)
    path = _save(run / "checkpoints", 7)
    assert resolve_resume("auto", run) == path
    assert resolve_resume(True, run) == path
    assert resolve_resume("never", run) is None
    assert resolve_resume(path, tmp_path / "other") == path
    assert resolve_resume(str(run), tmp_path / "other") == path
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        resolve_resume(str(tmp_path / "elsewhere"), run)


def test_many_small_values_fit_in_a_group(tmp_path):
    # Thousands of per-parameter ints (Adam's "state.<i>.step") go into one JSON
    # attribute; HDF5 stores variable-length strings on the heap, past the 64 KiB limit.
    optimizer = {f"state.{i}.step": i for i in range(5000)}
    optimizer.update({"step": 5000, "lr": 1e-3})
    ckpt = load_checkpoint(_save(tmp_path, 1, optimizer=optimizer))
    assert ckpt.optimizer == optimizer and list(ckpt.optimizer) == list(optimizer)


# -- integrity: a changed byte anywhere in what was saved is named, never loaded --------
# Each test changes the file behind the checksum's back, as flipped bits on a disk would
# (HDF5 itself reads such data without complaint): only the CRC-32 check can notice.

def test_a_changed_array_element_fails_its_checksum_naming_file_and_dataset(tmp_path):
    path = _save(tmp_path, 3, model={"layer.weight": numpy.arange(6.0).reshape(2, 3)})
    with h5py.File(path, "r+") as f:
        f["model/layer.weight"][1, 2] = 5.000001          # data only: the CRC attr stays
    with pytest.raises(CheckpointError, match=r"checkpoint-00000003.h5 is corrupt: "
                                              r"/model/layer.weight .*fails its checksum"):
        load_checkpoint(path)


def test_a_changed_plain_value_fails_its_checksum_naming_the_group(tmp_path):
    path = _save(tmp_path, 3)
    with h5py.File(path, "r+") as f:
        text = f["sampler"].attrs["__json__"]
        f["sampler"].attrs["__json__"] = text.replace('"index": 3', '"index": 4')
        assert f["sampler"].attrs["__json__"] != text   # the edit took
    with pytest.raises(CheckpointError, match=r"checkpoint-00000003.h5 is corrupt: the plain "
                                              r"values of /sampler fail their checksum"):
        load_checkpoint(path)


def test_a_changed_step_fails_the_root_checksum(tmp_path):
    path = _save(tmp_path, 3)
    with h5py.File(path, "r+") as f:
        f.attrs["step"] = 4
    with pytest.raises(CheckpointError, match=r"checkpoint-00000003.h5 is corrupt: its step, "
                                              r"epoch and config fail their checksum"):
        load_checkpoint(path)


def test_an_intact_checkpoint_passes_every_checksum(tmp_path):
    # The other side of the three above: the checks pass what was written, to the bit.
    path = _save(tmp_path, 3, model={"layer.weight": numpy.arange(6.0).reshape(2, 3)})
    ckpt = load_checkpoint(path)
    assert ckpt.step == 3 and ckpt.sampler == {"epoch": 0, "index": 3}
    numpy.testing.assert_array_equal(ckpt.model["layer.weight"], numpy.arange(6.0).reshape(2, 3))
