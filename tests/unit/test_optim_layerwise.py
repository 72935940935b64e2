"""LARS and LAMB against NumPy transcriptions of the papers' updates (float64), and the
per-tensor norms on split layouts (ZeRO-like flat shards, tensor-parallel rows) on thread
ranks: the same steps as whole tensors on one rank, with one collective per step."""
from __future__ import annotations

import numpy
import pytest

from mpidl.autograd import Tensor
from mpidl.comm import split_counts
from mpidl.optim import LAMB, LARS, Segment, TensorNorms
from mpidl.testing import run_ranks

SHAPES = [(4, 3), (3,), (3, 5), (5, 2)]  # a matrix, a bias, two more matrices
STEPS = 4
SPLIT = [True, False, True, False]  # tensor-parallel runs: split by rows, or replicated


def problem(seed: int = 0):
    """Initial tensors and STEPS gradients per tensor (float64); tensor 2 starts at zero
    (a ratio of 1 by the rule) and tensor 3's gradient at step 1 is zero."""
    rng = numpy.random.default_rng(seed)
    w = [rng.standard_normal(s) for s in SHAPES]
    w[2][...] = 0.0
    grads = [[rng.standard_normal(s) * 10.0 ** (i - 2) for i, s in enumerate(SHAPES)]
             for _ in range(STEPS)]
    grads[1][3][...] = 0.0
    return w, grads


def ratio(num, den, max_trust=None):
    """The trust ratio, clipped; 1 (unclipped) where a norm is zero."""
    if not (num > 0 and den > 0):
        return 1.0
    return num / den if max_trust is None else min(num / den, max_trust)


def lamb_reference(w, grads, lr=0.01, b1=0.9, b2=0.999, eps=1e-6, wd=0.01, max_trust=10.0):
    """Algorithm 2 of You et al. 2019, tensor by tensor, as printed."""
    w = [x.copy() for x in w]
    m = [numpy.zeros_like(x) for x in w]
    v = [numpy.zeros_like(x) for x in w]
    for t, gs in enumerate(grads, start=1):
        for i, g in enumerate(gs):
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            r = (m[i] / (1 - b1 ** t)) / (numpy.sqrt(v[i] / (1 - b2 ** t)) + eps)
            excluded = w[i].ndim <= 1
            u = r if excluded else r + wd * w[i]
            k = 1.0 if excluded else ratio(numpy.linalg.norm(w[i]), numpy.linalg.norm(u),
                                           max_trust)
            w[i] = w[i] - lr * k * u
    return w


def lars_reference(w, grads, lr=0.5, momentum=0.9, wd=5e-4, eta=1e-3):
    """Algorithm 1 of You et al. 2017, tensor by tensor."""
    w = [x.copy() for x in w]
    buf = [numpy.zeros_like(x) for x in w]
    for gs in grads:
        for i, g in enumerate(gs):
            excluded = w[i].ndim <= 1
            decay = 0.0 if excluded else wd
            nw, ng = numpy.linalg.norm(w[i]), numpy.linalg.norm(g)
            local = 1.0 if excluded else ratio(eta * nw, ng + wd * nw)
            buf[i] = momentum * buf[i] + lr * local * (g + decay * w[i])
            w[i] = w[i] - buf[i]
    return w


def run_whole(cls, w, grads, **kw):
    params = [Tensor(x.copy(), requires_grad=True) for x in w]
    opt = cls(params, **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.copy()
        opt.step()
    return [p.data for p in params], opt


@pytest.mark.parametrize("cls,reference,kw", [
    (LAMB, lamb_reference, {"lr": 0.01}),
    (LARS, lars_reference, {"lr": 0.5}),
])
def test_the_update_is_the_papers(cls, reference, kw):
    w, grads = problem()
    got, _ = run_whole(cls, w, grads, **kw)
    want = reference(w, grads, **kw)
    for g, x in zip(got, want):
        numpy.testing.assert_allclose(g, x, rtol=1e-12, atol=1e-15)
    # The trust ratio does something here: plain scaling by lr would not give this.
    assert not numpy.allclose(got[0], w[0] - kw["lr"] * sum(gs[0] for gs in grads))


def test_lamb_ratio_is_clipped_and_a_zero_tensor_moves_by_its_direction():
    w, grads = problem()
    got, _ = run_whole(LAMB, w, grads, lr=0.01, max_trust=0.05)
    want = lamb_reference(w, grads, lr=0.01, max_trust=0.05)
    for g, x in zip(got, want):
        numpy.testing.assert_allclose(g, x, rtol=1e-12, atol=1e-15)
    assert numpy.abs(got[2]).max() > 0  # |w| = 0 at first: ratio 1, not 0


def flat_shards(rank: int, size: int):
    """Every tensor flattened into one buffer padded to ``size`` blocks (ZeRO's unit):
    this rank's block and the segments of it, by global element offsets."""
    sizes = [int(numpy.prod(s)) for s in SHAPES]
    offsets = numpy.cumsum([0] + sizes)
    block = -(-offsets[-1] // size)
    lo, hi = rank * block, min((rank + 1) * block, offsets[-1])
    segments = []
    for t, (a, b) in enumerate(zip(offsets, offsets[1:])):
        x, y = max(lo, a), min(hi, b)
        if x < y:
            segments.append(Segment(int(x - lo), int(y - lo), t))
    return lo, block, segments, offsets


def sharded_run(comm, cls, kw):
    w, grads = problem()
    lo, block, segments, offsets = flat_shards(comm.rank, comm.size)
    flat = numpy.zeros(block * comm.size)
    flat[:offsets[-1]] = numpy.concatenate([x.reshape(-1) for x in w])
    p = Tensor(flat[lo:lo + block].copy(), requires_grad=True)
    norms = TensorNorms([segments], [len(s) <= 1 for s in SHAPES], shards=comm)
    opt = cls([p], norms=norms, **kw)
    for gs in grads:
        gflat = numpy.zeros_like(flat)
        gflat[:offsets[-1]] = numpy.concatenate([g.reshape(-1) for g in gs])
        p.grad = gflat[lo:lo + block].copy()
        opt.step()
    return p.data, [c.name for c in comm.calls]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("cls,kw", [(LAMB, {"lr": 0.01}), (LARS, {"lr": 0.5})])
def test_zero_like_shards_step_as_whole_tensors_with_one_collective_per_step(size, cls, kw):
    w, grads = problem()
    whole, _ = run_whole(cls, w, grads, **kw)
    results = run_ranks(size, sharded_run, cls, kw)
    got = numpy.concatenate([data for data, _ in results])
    want = numpy.concatenate([x.reshape(-1) for x in whole])
    numpy.testing.assert_allclose(got[:want.size], want, rtol=1e-12, atol=1e-15)
    assert not got[want.size:].any()  # padding stays zero
    for _, calls in results:
        assert calls == ["allreduce_"] * STEPS


def tensor_parallel_run(comm, cls, kw):
    """Two matrices split by rows over ``comm`` (tensor parallelism); the bias and the
    last matrix replicated, whole on every rank (a replicated matrix's norm must count
    once, not once per rank)."""
    w, grads = problem()
    split = SPLIT

    def mine(x, t):
        if not split[t]:
            return x.copy()
        counts = split_counts(x.shape[0], comm.size)
        start = sum(counts[:comm.rank])
        return x[start:start + counts[comm.rank]].copy()

    params = [Tensor(mine(x, t), requires_grad=True) for t, x in enumerate(w)]
    norms = TensorNorms.whole(params, split=split, tensor=comm)
    norms.excluded[:] = [len(s) <= 1 for s in SHAPES]  # shards of 3x5 are 1x5: still 2-D
    opt = cls(params, norms=norms, **kw)
    for gs in grads:
        for t, (p, g) in enumerate(zip(params, gs)):
            p.grad = mine(g, t)
        opt.step()
    return [p.data for p in params], [c.name for c in comm.calls]


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("cls,kw", [(LAMB, {"lr": 0.01}), (LARS, {"lr": 0.5})])
def test_tensor_parallel_rows_step_as_whole_tensors(size, cls, kw):
    w, grads = problem()
    whole, _ = run_whole(cls, w, grads, **kw)
    results = run_ranks(size, tensor_parallel_run, cls, kw)
    for t, x in enumerate(whole):
        if SPLIT[t]:
            got = numpy.concatenate([data[t] for data, _ in results])
        else:
            got = results[0][0][t]
            for data, _ in results:  # a replicated tensor stays alike everywhere
                numpy.testing.assert_array_equal(data[t], got)
        numpy.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-15)
    for _, calls in results:
        assert calls == ["allreduce_"] * STEPS


def test_norms_that_do_not_match_the_parameters_are_refused():
    p = [Tensor(numpy.zeros(3), requires_grad=True)]
    with pytest.raises(ValueError, match="norms describe 2 parameters"):
        LAMB(p, norms=TensorNorms([[Segment(0, 3, 0)], []], [False]))
    with pytest.raises(ValueError, match="outside"):
        TensorNorms([[Segment(0, 3, 1)]], [False])


def reduced_sums(comm):
    """Rank r holds rows of tensor 0 (split) and all of tensor 1 (replicated)."""
    sums = numpy.array([[float(comm.rank + 1), 5.0]])
    TensorNorms([[]], [False, False], split=[True, False], tensor=comm).reduce(sums)
    return sums


@pytest.mark.parametrize("size", [2, 3])
def test_a_replicated_tensor_counts_once_and_a_split_one_adds_up(size):
    # The ratios alone cannot show this (|w| and |u| would scale alike): the sums can.
    for sums in run_ranks(size, reduced_sums):
        numpy.testing.assert_array_equal(sums, [[size * (size + 1) / 2, 5.0]])
