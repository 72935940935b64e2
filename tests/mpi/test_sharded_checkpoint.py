"""Sharded checkpoints at any size: saved in one layout, loaded in another, equal to one
rank in float64; each rank reads only its share, in memory near its share.

The bodies take ``comm`` and a directory every rank sees, so tests/unit runs them again
on thread ranks at other sizes (tests/unit/test_sharded_checkpoint.py).
"""
from __future__ import annotations

import os

import numpy
import pytest

from mpidl.functions import softmax_cross_entropy
from mpidl.models import mlp
from mpidl.nn import BatchNorm1d, Linear, Module
from mpidl.optim import AdamW
from mpidl.parallel import DataParallel, ShardedDataParallel
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks
from mpidl.testing.models import full_parameters
from mpidl.testing.memory import peak_bytes
from mpidl.train import checkpoint as ckpt
from mpidl.train.checkpointer import choose_checkpointer

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

LAYOUTS = [0, 1, 2, 3]  # 0: data parallel, else the ZeRO stage
PER_RANK = 4
SIZES = (7, 11, 5)      # 148 parameters: blocks padded at 2 and 3 ranks


def build(comm, layout, seed=4, sizes=SIZES, bucket_mb=0.0005):
    """A model, its wrapper and AdamW at ``layout``; several ZeRO units."""
    model = mlp(sizes=sizes, seed=seed, dtype="float64")
    wrapper = (ShardedDataParallel(model, comm, stage=layout, bucket_mb=bucket_mb) if layout
               else DataParallel(model, comm))
    return model, wrapper, AdamW(wrapper.parameters(), lr=1e-2, weight_decay=0.1)


def batches(steps, n, seed=1):
    rng = numpy.random.default_rng(seed)
    return [(rng.standard_normal((n, SIZES[0])), rng.integers(0, SIZES[-1], size=n))
            for _ in range(steps)]


def train(comm, wrapper, opt, data):
    for x, y in data:
        lo = PER_RANK * comm.rank
        loss = softmax_cross_entropy(wrapper(x[lo:lo + PER_RANK]), y[lo:lo + PER_RANK],
                                     reduction="sum")
        wrapper.backward(loss, global_count=len(x))
        opt.step()
        opt.zero_grad()


def reference(comm, steps):
    """One rank, the global batches: the expected parameters after ``steps``."""
    model = mlp(sizes=SIZES, seed=4, dtype="float64")
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches(steps, PER_RANK * comm.size):
        softmax_cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save_at(comm, directory, layout, steps=2):
    model, wrapper, opt = build(comm, layout)
    train(comm, wrapper, opt, batches(steps, PER_RANK * comm.size))
    path = choose_checkpointer(comm, None, wrapper, model, opt).save(
        directory, steps, rng={"numpy": {"seed": 1}}, sampler={"epoch": 0, "index": steps},
        config="x = 1", epoch=0, extra={"ranks": comm.size})
    wrapper.close() if hasattr(wrapper, "close") else None
    return path


@pytest.mark.parametrize("saved_as", LAYOUTS)
@pytest.mark.parametrize("loaded_as", LAYOUTS)
def test_a_checkpoint_saved_in_one_layout_resumes_in_another_as_one_rank_would(
        comm, shared_dir, saved_as, loaded_as):
    directory = os.path.join(shared_dir, f"{saved_as}-{loaded_as}")
    path = save_at(comm, directory, saved_as)
    model, wrapper, opt = build(comm, loaded_as, seed=9)  # other weights: all overwritten
    checkpointer = choose_checkpointer(comm, None, wrapper, model, opt)
    read = checkpointer.load(ckpt.load_checkpoint(path, "none"))
    held, _ = checkpointer.holdings()
    assert_all_ranks(comm, read == sum(h.count for h in held),
                     f"read {read} elements; this rank holds {sum(h.count for h in held)}")
    expected, expected_opt = reference(comm, 2)
    got = full_parameters(wrapper)
    for name, q in expected.named_parameters():
        assert_allclose_all_ranks(comm, got[name], q.data, scale=10.0, what=f"loaded {name}")
    # One more step at the new layout: the optimizer state came back too.
    train(comm, wrapper, opt, batches(3, PER_RANK * comm.size)[2:])
    expected, _ = reference(comm, 3)
    got = full_parameters(wrapper)
    for name, q in expected.named_parameters():
        assert_allclose_all_ranks(comm, got[name], q.data, scale=10.0, what=f"stepped {name}")
    if hasattr(wrapper, "close"):
        wrapper.close()


@pytest.mark.parametrize("layout", [0, 3])
def test_the_sharded_checkpoint_assembles_into_the_single_rank_state(comm, shared_dir, layout):
    path = save_at(comm, os.path.join(shared_dir, f"full-{layout}"), layout)
    full = ckpt.load_checkpoint(path)  # every rank, whole: a small test model
    expected, expected_opt = reference(comm, 2)
    for name, q in expected.named_parameters():
        assert_allclose_all_ranks(comm, full.model[name], q.data, scale=10.0, what=name)
    want = expected_opt.state_dict()
    assert_all_ranks(comm, sorted(full.optimizer) == sorted(want),
                     f"keys {sorted(full.optimizer)} != {sorted(want)}")
    for key, value in want.items():
        if hasattr(value, "shape"):
            assert_allclose_all_ranks(comm, full.optimizer[key], value, scale=10.0, what=key)
        else:
            assert_all_ranks(comm, full.optimizer[key] == value, f"{key}: "
                             f"{full.optimizer[key]} != {value}")
    assert_all_ranks(comm, (full.step, full.sampler, full.extra["ranks"]) ==
                     (2, {"epoch": 0, "index": 2}, comm.size), f"{full}")


# -- buffers: BatchNorm's running statistics ---------------------------------------------------

class BatchNormed(Module):
    """A linear layer and a BatchNorm1d: parameters and buffers (a float64 mean and
    variance, an int64 count), the state eval and predict need whole."""

    def __init__(self, seed=4):
        super().__init__()
        self.lin = Linear(SIZES[0], 3, seed=seed, dtype="float64")
        self.norm = BatchNorm1d(3, dtype="float64")

    def forward(self, x):
        return self.norm(self.lin(x))


# Not the initial 0, 1 and 0: a checkpoint that lost them would read as a fresh model.
STATISTICS = {"norm.running_mean": numpy.array([0.5, -1.5, 2.5]),
              "norm.running_var": numpy.array([4.0, 0.25, 9.0]),
              "norm.num_batches_tracked": numpy.array(7)}


def build_batch_normed(comm, layout, seed=4):
    model = BatchNormed(seed)
    wrapper = (ShardedDataParallel(model, comm, stage=layout, bucket_mb=0.0005) if layout
               else DataParallel(model, comm))
    return model, wrapper, AdamW(wrapper.parameters(), lr=1e-2)


def save_batch_normed(comm, directory, layout):
    """Every rank holds the same statistics (as the wrappers keep rank 0's); saved at
    ``layout``. Returns the checkpoint's path and the single-rank state saved."""
    model, wrapper, opt = build_batch_normed(comm, layout)
    for name, value in STATISTICS.items():
        dict(model.named_buffers())[name][...] = value
    path = choose_checkpointer(comm, None, wrapper, model, opt).save(
        directory, 1, rng={}, sampler={})
    expected = {**full_parameters(wrapper), **STATISTICS}
    wrapper.close() if hasattr(wrapper, "close") else None
    return path, expected


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batch_norm_statistics_come_back_from_a_sharded_checkpoint_whole_and_resharded(
        comm, shared_dir, layout):
    path, expected = save_batch_normed(comm, os.path.join(shared_dir, f"bn-{layout}"), layout)
    # Whole, as consolidate, eval and predict read it: every parameter and buffer.
    for what in ("model", "full"):
        got = ckpt.load_checkpoint(path, what).model
        assert_all_ranks(comm, sorted(got) == sorted(expected),
                         f"{what}: tensors {sorted(got)} != {sorted(expected)}")
        for name, value in expected.items():
            assert_all_ranks(comm, numpy.asarray(got[name]).dtype == value.dtype,
                             f"{what}: {name} is {numpy.asarray(got[name]).dtype}")
            assert_allclose_all_ranks(comm, numpy.asarray(got[name]), value,
                                      what=f"{what}: {name}")
    # Resumed in another layout (data parallel <-> ZeRO 3, ZeRO 1 <-> 2): the buffers come
    # back into the model.
    model, wrapper, opt = build_batch_normed(comm, 3 - layout, seed=9)
    choose_checkpointer(comm, None, wrapper, model, opt).load(ckpt.load_checkpoint(path, "none"))
    buffers = dict(model.named_buffers())
    for name, value in STATISTICS.items():
        assert_allclose_all_ranks(comm, numpy.asarray(buffers[name]), value,
                                  what=f"resumed {name}")
    wrapper.close() if hasattr(wrapper, "close") else None


# -- memory: a rank's share plus one tensor ---------------------------------------------------
WIDE = (128,) * 7  # six 128x128 float64 weights: 128 KiB each


@pytest.mark.parametrize("stage", [1, 3])
def test_saving_and_loading_a_zero_checkpoint_takes_a_share_plus_one_tensor(
        comm, shared_dir, stage):
    directory = os.path.join(shared_dir, f"memory-{stage}")
    model, wrapper, opt = build(comm, stage, sizes=WIDE, bucket_mb=0.1)
    x = numpy.random.default_rng(0).standard_normal((PER_RANK * comm.size, WIDE[0]))
    y = numpy.zeros(len(x), dtype=numpy.int64)
    train(comm, wrapper, opt, [(x, y)])
    checkpointer = choose_checkpointer(comm, None, wrapper, model, opt)
    checkpointer.save(directory, 1, rng={}, sampler={})  # first use: imports, HDF5 setup
    tensor = WIDE[0] * WIDE[1] * 8
    path, saving = peak_bytes(lambda: checkpointer.save(directory, 2, rng={}, sampler={}))
    wrapper.close()
    model, wrapper, opt = build(comm, stage, sizes=WIDE, bucket_mb=0.1)
    checkpointer = choose_checkpointer(comm, None, wrapper, model, opt)
    state = ckpt.load_checkpoint(path, "none")
    _, loading = peak_bytes(lambda: checkpointer.load(state))
    share = sum(s.data.nbytes for s in wrapper.parameters()) * 2  # the Adam moments made
    # The records themselves (runs, closures) and HDF5's metadata: a few KiB each.
    slack = (64 << 10) + (4 << 10) * len(checkpointer.holdings()[0])
    state_bytes = 3 * sum(p.size for p in mlp(sizes=WIDE, seed=0).parameters()) * 8
    assert_all_ranks(comm, saving <= tensor + slack and loading <= share + 2 * tensor + slack,
                     f"peaks: saving {saving} B, loading {loading} B; share {share} B, one "
                     f"tensor {tensor} B, slack {slack} B (the whole state: {state_bytes} B)")
    wrapper.close()
