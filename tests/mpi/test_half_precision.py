"""Half precision through real MPI: bfloat16 has no MPI type, so it moves as uint16 bit
patterns (broadcasts, gathers, ZeRO-3's parameter gathers) and is never reduced; fp32
gradients of half parameters are reduced in fp32. Correct at any size."""
from __future__ import annotations

import numpy
import pytest

from mpidl import backend
from mpidl.comm import split_counts
from mpidl.models import gpt
from mpidl.optim import SGD, MasterWeights
from mpidl.parallel import DataParallel, ShardedDataParallel
from mpidl.testing import assert_all_ranks, raises_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]
BF16 = backend.bfloat16()


def test_bfloat16_moves_bit_exact_and_is_never_reduced(comm):
    mine = numpy.arange(5, dtype=numpy.float32).astype(BF16) + comm.rank
    got = comm.allgather(mine)
    want = numpy.stack([numpy.arange(5, dtype=numpy.float32).astype(BF16) + r
                        for r in range(comm.size)])
    assert_all_ranks(comm, got.dtype == BF16 and numpy.array_equal(
        got.view(numpy.uint16), want.view(numpy.uint16)), "bfloat16 allgather")
    root = numpy.full(3, 1.5 + comm.rank, dtype=numpy.float32).astype(BF16)
    comm.bcast_(root, root=0)
    assert_all_ranks(comm, bool((root == BF16.type(1.5)).all()), "bfloat16 bcast_")
    with raises_all_ranks(comm, TypeError, match="MPI has no bfloat16"):
        comm.allreduce_(numpy.ones(4, dtype=BF16))


@pytest.mark.parametrize("layout", ["dp", 2, 3])
def test_bfloat16_training_keeps_every_rank_alike(comm, layout):
    model = gpt(vocab=23, seq_len=8, dim=6, layers=2, heads=2, seed=3).half_(BF16)
    if layout == "dp":
        wrapper = DataParallel(model, comm, grad_dtype="float32")
    else:
        wrapper = ShardedDataParallel(model, comm, stage=layout, bucket_mb=0.0005,
                                      grad_dtype="float32")
    opt = MasterWeights(SGD(wrapper.parameters(), lr=0.5))
    rng = numpy.random.default_rng(0)
    for _ in range(2):
        ids = rng.integers(0, 23, size=(2 * comm.size + 1, 8))
        counts = split_counts(len(ids), comm.size)
        a = sum(counts[:comm.rank])
        wrapper.before_forward()
        wrapper.backward(model.loss(ids[a:a + counts[comm.rank]], reduction="sum"),
                         global_count=ids[:, 1:].size)
        assert_all_ranks(comm, all(p.grad.dtype == numpy.float32 for p in opt.params
                                   if p.grad is not None), "fp32 gradients")
        opt.step()
        opt.zero_grad()
    wrapper.before_forward()
    loss = model.loss(ids, reduction="sum").data  # every rank the whole batch
    same = comm.allgather(numpy.asarray([float(loss)]))
    assert_all_ranks(comm, numpy.isfinite(same).all() and (same == same[0]).all(),
                     f"every rank evaluates the same bfloat16 model: {same.ravel()}")
    wrapper.close()
