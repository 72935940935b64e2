"""LARS and LAMB on ZeRO 1-3 at 2 and 3 thread ranks equal one rank (float64): every
model tensor's trust ratio comes from its whole norm, though a rank's shard holds parts
of several tensors and a tensor's parts lie on several ranks."""
from __future__ import annotations

import numpy
import pytest

from mpidl.comm import split_counts
from mpidl.functions import softmax_cross_entropy
from mpidl.models import gpt
from mpidl.optim import LAMB, LARS
from mpidl.parallel import ShardedDataParallel
from mpidl.testing import run_ranks

BATCH, STEPS = 13, 3
OPTIMIZERS = {"lamb": (LAMB, {"lr": 0.02, "weight_decay": 0.1}),
              "lars": (LARS, {"lr": 5.0, "weight_decay": 0.01})}


def small_gpt():
    # vocabulary 23, width 6: no parameter count divides 2 or 3 ranks evenly
    return gpt(vocab=23, seq_len=8, dim=6, layers=2, heads=2, seed=3, dtype="float64")


def batches():
    rng = numpy.random.default_rng(0)
    for _ in range(STEPS):
        ids = rng.integers(0, 23, size=(BATCH, 8))
        yield ids[:, :-1], ids[:, 1:]


def one_rank(name):
    cls, kw = OPTIMIZERS[name]
    model = small_gpt()
    opt = cls(model.parameters(), **kw)
    for x, y in batches():
        loss = softmax_cross_entropy(model(x), y, reduction="sum") * (1.0 / y.size)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.data for p in model.parameters()]


def sharded(comm, name, stage):
    cls, kw = OPTIMIZERS[name]
    model = small_gpt()
    sdp = ShardedDataParallel(model, comm, stage=stage, bucket_mb=0.0005)
    opt = cls(sdp.parameters(), norms=sdp.tensor_norms(), **kw)
    for x, y in batches():
        counts = split_counts(len(x), comm.size)
        a = sum(counts[:comm.rank])
        b = a + counts[comm.rank]
        sdp.backward(softmax_cross_entropy(sdp(x[a:b]), y[a:b], reduction="sum"),
                     global_count=y.size)
        opt.step()
        opt.zero_grad()
    # The full parameters from every rank's shards, by the model's order.
    flat = {id(p): None for p in model.parameters()}
    for u in sdp.units:
        full = comm.allgather(u.shard.data).reshape(-1)
        for p, a, b, shape in zip(u.params, u.offsets, u.offsets[1:], u.shapes):
            flat[id(p)] = full[a:b].reshape(shape)
    sdp.close()
    return [flat[id(p)] for p in model.parameters()]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_stages_equal_one_rank(name, stage, size):
    want = one_rank(name)
    start = small_gpt()
    moved = [float(numpy.abs(w - p.data).max()) for w, p in zip(want, start.parameters())]
    assert min(moved) > 0  # every tensor was updated: a tensor the test skips would pass
    for got in run_ranks(size, sharded, name, stage):
        for g, w in zip(got, want):
            numpy.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13)


def grid_run(comm, name, tensor, zero):
    """A tensor-parallel GPT (data parallel over the rest, or ZeRO on the replicas) with
    the layer-wise optimizer over the norms ``mpidl train``'s layout gives it; the
    single-rank state at the end."""
    from mpidl.parallel import DataParallel, parallel_gpt
    from mpidl.train.layout import Layout, LayoutPlan

    cls, kw = OPTIMIZERS[name]
    if tensor > 1:
        layout = Layout(LayoutPlan(tensor=tensor, data=comm.size // tensor, zero=zero), comm)
        model = parallel_gpt(layout.grid, vocab=23, seq_len=8, dim=6, layers=2, heads=2,
                             seed=3, dtype="float64")
    else:  # as mpidl train plans a whole model: no grid, and no ZeRO stage in the plan
        layout = Layout(LayoutPlan(data=comm.size), comm)
        model = small_gpt()
    grid = layout.grid
    if zero:
        wrapper = ShardedDataParallel(model, layout.replicas, stage=zero, bucket_mb=0.0005)
    else:
        wrapper = DataParallel(model, layout.replicas)
    opt = cls(wrapper.parameters(), norms=layout.tensor_norms(wrapper), **kw)
    for x, y in batches():
        ids = numpy.concatenate([x, y[:, -1:]], axis=1)
        data = layout.data
        counts = split_counts(len(ids), data.size)
        a = sum(counts[:data.rank])
        mine = ids[a:a + counts[data.rank]]
        wrapper.before_forward()  # ZeRO: the shards' last update, gathered
        wrapper.backward(model.loss(mine, reduction="sum"), global_count=y.size)
        opt.step()
        opt.zero_grad()
    if zero:
        wrapper.gather_parameters()
        if zero == 3:
            pytest.skip("stage 3 full state: gathered inside forward only")
    state = (model.full_state_dict() if grid is not None else
             {n: p.data.copy() for n, p in model.named_parameters()})
    wrapper.close()
    layout.free()
    return state


@pytest.mark.parametrize("size,tensor,zero", [(2, 2, 0), (4, 2, 0), (4, 2, 1),
                                              (4, 2, 2), (2, 1, 2), (3, 1, 1)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_mpidl_train_layouts_equal_one_rank(name, size, tensor, zero):
    want = dict(zip([n for n, _ in small_gpt().named_parameters()], one_rank(name)))
    for state in run_ranks(size, grid_run, name, tensor, zero):
        for key, w in want.items():
            numpy.testing.assert_allclose(state[key], w, rtol=1e-10, atol=1e-13,
                                          err_msg=key)
