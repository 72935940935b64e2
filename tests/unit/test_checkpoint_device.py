"""Checkpoints of device arrays: a grid (tensor or sequence) with ZeRO over its replicas,
its parameters, shards and optimizer state on the (fake) GPU, saves and resumes exactly
as the same run on the host does.

Issue #24's defect: with CuPy, ``--zero`` on a tensor/sequence grid could not checkpoint:
every piece went through ``allgather_obj`` (pickled device arrays) and then
``numpy.asarray``, which CuPy refuses. :mod:`mpidl.testing.fakedevice` makes device
arrays a type of their own that refuses it too (and pickles as a device array), so the
old path fails here with CuPy's TypeError (checked against the code before the sharded
format: ``Layout.full_state`` -> ``zero.assemble`` -> ``numpy.asarray``). The fake
computes nothing, so the host trains and the device run loads, then saves.
"""
from __future__ import annotations

import os

import numpy
import pytest

from mpidl.backend import as_numpy
from mpidl.optim import AdamW
from mpidl.parallel import DataParallel, ShardedDataParallel, parallel_gpt
from mpidl.testing import run_ranks
from mpidl.testing.fakedevice import FakeDeviceArray, fake_cupy
from mpidl.train import checkpoint as ckpt
from mpidl.train.checkpointer import choose_checkpointer
from mpidl.train.layout import Layout, LayoutPlan

KW = dict(vocab=11, seq_len=8, dim=8, layers=1, heads=2, ffn=16, dtype="float64")
RANKS = 4  # a 2-way grid axis x 2 replicas: ZeRO shards each grid rank's state in two


def build(comm, axis, zero, seed, xp=None):
    """The grid run: ``axis`` ("tensor" or "sequence") of 2 ranks, ZeRO ``zero`` over
    the replicas (0: none), its arrays on ``xp`` (None: the host)."""
    plan = LayoutPlan(**{axis: 2}, data=comm.size // 2, zero=zero,
                      attention="ring" if axis == "sequence" else "none")
    layout = Layout(plan, comm)
    model = parallel_gpt(layout.grid, seed=seed, **KW)
    if xp is not None:
        model.to(xp)
    if zero:
        wrapper = ShardedDataParallel(model, layout.replicas, stage=zero)
    else:  # data parallelism over the replicas; the device run only loads and saves
        wrapper = None if xp is not None else DataParallel(model, layout.replicas)
    opt = AdamW((wrapper or model).parameters(), lr=0.1, weight_decay=0.1)
    return layout, model, wrapper, opt


def local_state(model, wrapper, opt):
    """This rank's arrays, on the host: parameters (stages 0-2 hold them whole), the
    ZeRO shards, the optimizer state."""
    out = {}
    zero = isinstance(wrapper, ShardedDataParallel)
    if zero:
        wrapper.gather_parameters()  # stages 1-2: the full parameters after the step
    if not zero or wrapper.stage < 3:
        out.update({n: as_numpy(p.data) for n, p in model.named_parameters()})
    for i, u in enumerate(wrapper.units if zero else ()):
        out[f"shard.{i}"] = as_numpy(u.shard.data)
    for i, st in enumerate(opt.state):
        out.update({f"opt.{i}.{k}": as_numpy(v) for k, v in st.items() if hasattr(v, "shape")})
    return out


def trained_then_saved(comm, axis, zero, directory):
    """The host run: one AdamW step (so the optimizer has state), then a checkpoint."""
    layout, model, wrapper, opt = build(comm, axis, zero, seed=2)
    ids = numpy.random.default_rng(layout.data.rank).integers(0, KW["vocab"], (2, 9))
    loss = model.loss(ids, reduction="sum")
    n = 2 * KW["seq_len"] * layout.data.size
    wrapper.backward(loss, global_count=n)
    opt.step()
    path = choose_checkpointer(comm, layout, wrapper, model, opt).save(
        directory, 1, rng={}, sampler={})
    state = local_state(model, wrapper, opt)
    layout.free()
    return path, state


def resumed_then_saved(comm, axis, zero, path, directory, xp):
    """The device run: built from another seed, resumed from the host's checkpoint, saved
    again; its arrays must still be device arrays."""
    layout, model, wrapper, opt = build(comm, axis, zero, seed=5, xp=xp)
    checkpointer = choose_checkpointer(comm, layout, wrapper, model, opt)
    checkpointer.load(ckpt.load_checkpoint(path, "none"))
    again = checkpointer.save(directory, 1, rng={}, sampler={})
    arrays = [p.data for p in model.parameters()] + [
        v for st in opt.state for v in st.values() if hasattr(v, "shape")]
    on_host = sum(not isinstance(a, FakeDeviceArray) for a in arrays)
    state = local_state(model, wrapper, opt)
    layout.free()
    return again, state, on_host


@pytest.mark.parametrize("axis,zero", [("tensor", 1), ("tensor", 2), ("tensor", 3),
                                       ("sequence", 2), ("tensor", 0)])
def test_a_grid_with_zero_on_the_device_saves_and_resumes_as_the_host_run(tmp_path, axis,
                                                                         zero):
    host = run_ranks(RANKS, trained_then_saved, axis, zero, str(tmp_path / "host"),
                     timeout=60)
    with fake_cupy() as cp:
        device = run_ranks(RANKS, resumed_then_saved, axis, zero, host[0][0],
                           str(tmp_path / "device"), cp, timeout=60)
    for (_, expected), (_, got, on_host) in zip(host, device):
        assert on_host == 0
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():  # the resumed run holds what the host held
            numpy.testing.assert_array_equal(got[name], value, err_msg=name)
    saved = ckpt.load_checkpoint(host[0][0], "full")
    again = ckpt.load_checkpoint(device[0][0], "full")
    assert sorted(again.model) == sorted(saved.model)
    for name, value in saved.model.items():
        numpy.testing.assert_array_equal(again.model[name], value, err_msg=name)
    assert sorted(again.optimizer) == sorted(saved.optimizer)
    for name, value in saved.optimizer.items():
        numpy.testing.assert_array_equal(again.optimizer[name], value, err_msg=name)
    # The same pieces, byte for byte: the two indexes name the same pieces, CRC-32s too.
    assert sorted(os.listdir(tmp_path / "host")) == sorted(os.listdir(tmp_path / "device"))
    saved, again = (ckpt.load_checkpoint(run[0][0], "none").index for run in (host, device))
    for table in ("pieces", "crc"):
        numpy.testing.assert_array_equal(numpy.asarray(again[table]),
                                         numpy.asarray(saved[table]))


def test_a_device_array_refuses_numpy_and_pickles_as_a_device_array():
    # What the test above relies on the fake for: CuPy's behaviour.
    import pickle

    with fake_cupy() as cp:
        x = cp.asarray(numpy.arange(3.0))
        with pytest.raises(TypeError, match="Implicit conversion"):
            numpy.asarray(x)
        y = pickle.loads(pickle.dumps(x))
        assert isinstance(y, FakeDeviceArray)
        numpy.testing.assert_array_equal(y.get(), [0.0, 1.0, 2.0])
        with pytest.raises(TypeError, match="host array"):
            cp.stack([x, numpy.arange(3.0)])
