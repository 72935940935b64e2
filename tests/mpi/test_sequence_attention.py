"""Ulysses and ring attention on a sequence split over the ranks == full attention.

Every rank computes the single-process reference on the whole sequence, in float64,
and compares its own tokens' outputs and input gradients (padded positions must get
zeros). Sequence lengths are chosen so that some do not divide the group (padding).
"""
from __future__ import annotations

import numpy
import pytest

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn.attention import merge_heads, split_heads
from mpidl.parallel.ring import ring_attention
from mpidl.parallel.sequence import SequenceLayout, ulysses_attention
from mpidl.testing import assert_allclose_all_ranks, raises_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def full_inputs(shape, seed=0):
    rng = numpy.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(4)]  # q, k, v, output weights


def reference(q, k, v, w, causal, mask=None):
    ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    y = F.scaled_dot_product_attention(*ts, causal=causal, mask=mask)
    F.sum(F.mul(y, w)).backward()
    return y.data, [t.grad for t in ts]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("length", [12, 7, 1])
def test_ring_attention_matches_full_attention(comm, causal, zigzag, length):
    q, k, v, w = full_inputs((2, 2, length, 3))
    ref_y, ref_grads = reference(q, k, v, w, causal)
    layout = SequenceLayout(length, comm.size, comm.rank, zigzag=zigzag)
    mine = [Tensor(layout.split(a, axis=2), requires_grad=True) for a in (q, k, v)]
    y = ring_attention(*mine, comm=comm, layout=layout, causal=causal)
    F.sum(F.mul(y, layout.split(w, axis=2))).backward()
    real = layout.valid()
    assert_allclose_all_ranks(comm, y.data[:, :, real], layout.split(ref_y, axis=2)[:, :, real],
                              what="output")
    for name, t, g in zip("qkv", mine, ref_grads):
        assert_allclose_all_ranks(comm, t.grad, layout.split(g, axis=2), what=f"d{name}")


def test_ring_attention_merges_in_float32_for_float16_inputs(comm):
    q, k, v, w = full_inputs((1, 2, 9, 4), seed=3)
    ref_y, _ = reference(q, k, v, w, causal=True)
    layout = SequenceLayout(9, comm.size, comm.rank, zigzag=True)
    mine = [Tensor(layout.split(a, axis=2).astype(numpy.float16)) for a in (q, k, v)]
    y = ring_attention(*mine, comm=comm, layout=layout, causal=True)
    real = layout.valid()
    assert_allclose_all_ranks(comm, y.data[:, :, real],
                              layout.split(ref_y, axis=2)[:, :, real].astype(numpy.float16),
                              what="float16 output")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("length", [12, 7])
def test_ulysses_attention_matches_full_attention(comm, causal, length):
    heads, dh = 2 * comm.size, 3
    rng = numpy.random.default_rng(1)
    qkv = rng.standard_normal((2, length, 3 * heads * dh))
    w = rng.standard_normal((2, length, heads * dh))
    full = Tensor(qkv, requires_grad=True)
    ref = merge_heads(F.scaled_dot_product_attention(*split_heads(full, heads), causal=causal))
    F.sum(F.mul(ref, w)).backward()
    layout = SequenceLayout(length, comm.size, comm.rank)
    mine = Tensor(layout.split(qkv), requires_grad=True)
    y = ulysses_attention(mine, comm, heads, causal, layout)
    F.sum(F.mul(y, layout.split(w))).backward()
    real = layout.valid()
    assert_allclose_all_ranks(comm, y.data[:, real], layout.split(ref.data)[:, real],
                              what="output")
    assert_allclose_all_ranks(comm, mine.grad, layout.split(full.grad), what="dqkv")


def test_ulysses_refuses_heads_the_group_does_not_divide(comm):
    if comm.size == 1:
        pytest.skip("one rank divides every head count")
    layout = SequenceLayout(4 * comm.size, comm.size, comm.rank)
    qkv = numpy.zeros((1, 4, 3 * (comm.size + 1)))
    with raises_all_ranks(comm, ValueError, match="not divisible"):
        ulysses_attention(qkv, comm, comm.size + 1, True, layout)
