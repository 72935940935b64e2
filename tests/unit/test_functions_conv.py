"""conv1d/2d/3d: forward against a direct loop over output positions, backward against
finite differences (float64), both against PyTorch's ``conv{d}d`` when it is installed;
the chunked unfolding (large volumes) against the one-chunk path."""
from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy
import pytest

import mpidl.functions as F
import mpidl.functions.conv as conv
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.testing import allclose
from mpidl.testing.gradcheck import gradcheck

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _randn(xp, *shape, seed=0, dtype=numpy.float64):
    return xp.asarray(numpy.random.default_rng(seed).standard_normal(shape).astype(dtype))


def reference_conv(x, w, b, stride, padding, dilation, groups):
    """The definition, one output position at a time:
    ``y[n, o, p] = b[o] + sum_{c in o's group, k} w[o, c, k] x[n, c, p s + k d - pad]``."""
    x, w = as_numpy(x), as_numpy(w)
    d = w.ndim - 2
    s, dl = conv.ntuple(stride, d, "s"), conv.ntuple(dilation, d, "d")
    pads = conv.conv_padding(padding, w.shape[2:], dl, s)
    xpad = numpy.pad(x, [(0, 0), (0, 0)] + list(pads))
    out = [conv.output_size(n, k, st, p, dd) for n, k, st, p, dd in
           zip(x.shape[2:], w.shape[2:], s, pads, dl)]
    o, cg = w.shape[:2]
    og = o // groups
    y = numpy.zeros((x.shape[0], o) + tuple(out))
    for pos in itertools.product(*(range(n) for n in out)):
        window = tuple(slice(p * st, p * st + dd * (k - 1) + 1, dd)
                       for p, st, dd, k in zip(pos, s, dl, w.shape[2:]))
        for grp in range(groups):
            patch = xpad[(slice(None), slice(grp * cg, (grp + 1) * cg)) + window]  # (B, Cg, *K)
            wg = w[grp * og:(grp + 1) * og]  # (Og, Cg, *K)
            y[(slice(None), slice(grp * og, (grp + 1) * og)) + pos] = numpy.tensordot(
                patch, wg, axes=(list(range(1, d + 2)), list(range(1, d + 2))))
    if b is not None:
        y += as_numpy(b).reshape((1, o) + (1,) * d)
    return y


# (d, spatial size, in, out, kernel, stride, padding, dilation, groups)
CASES = [
    (1, (9,), 4, 6, 3, 1, 1, 1, 1),
    (1, (10,), 4, 6, 2, 2, 0, 1, 2),
    (1, (11,), 6, 4, 3, 2, 2, 2, 2),
    (2, (7, 6), 3, 4, 3, 1, 1, 1, 1),
    (2, (8, 7), 4, 6, (2, 3), (2, 1), (0, 1), (1, 2), 2),
    (2, (9, 9), 4, 4, 3, 2, 1, 2, 4),  # depthwise
    (2, (6, 5), 2, 3, 2, 1, "same", 1, 1),  # even kernel: the extra padding goes after
    (3, (5, 4, 6), 2, 4, 3, 1, 1, 1, 1),
    (3, (6, 5, 5), 4, 2, 2, 2, 0, 1, 2),
    (3, (7, 6, 5), 2, 2, (3, 2, 2), (2, 1, 1), (1, 0, 1), (1, 2, 1), 1),
    (3, (4, 5, 4), 1, 2, 2, 1, "same", 1, 1),
]
IDS = [f"{c[0]}d-k{c[4]}-s{c[5]}-p{c[6]}-d{c[7]}-g{c[8]}" for c in CASES]


def _case(xp, case, batch=2, bias=True):
    d, size, cin, cout, k, s, p, dl, g = case
    kernel = conv.ntuple(k, d, "k")
    x = _randn(xp, batch, cin, *size, seed=1)
    w = _randn(xp, cout, cin // g, *kernel, seed=2)
    b = _randn(xp, cout, seed=3) if bias else None
    return x, w, b, dict(stride=s, padding=p, dilation=dl, groups=g)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_conv_forward_matches_the_definition(xp, case):
    x, w, b, kw = _case(xp, case)
    y = CONV[case[0]](Tensor(x), Tensor(w), Tensor(b), **kw)
    assert allclose(y.data, reference_conv(x, w, b, **kw))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_conv_gradients_match_finite_differences(xp, case):
    x, w, b, kw = _case(xp, case, batch=1 if case[0] == 3 else 2)
    fn = CONV[case[0]]
    assert gradcheck(lambda *ts: fn(*ts, **kw), [x, w, b])


@pytest.mark.parametrize("case", CASES[:3] + CASES[3:7:3] + CASES[7:8], ids=lambda c: f"{c[0]}d")
def test_conv_without_bias_gradchecks(xp, case):
    x, w, _, kw = _case(xp, case, batch=1, bias=False)
    assert gradcheck(lambda a, v: CONV[case[0]](a, v, None, **kw), [x, w])


@pytest.mark.extra("torch")
@pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_conv_matches_pytorch_forward_and_backward(case):
    torch = pytest.importorskip("torch")
    x, w, b, kw = _case(numpy, case, batch=3)
    ts = [Tensor(a, requires_grad=True) for a in (x, w, b)]
    y = CONV[case[0]](*ts, **kw)
    gy = numpy.random.default_rng(4).standard_normal(y.shape)
    y.backward(gy)
    refs = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    ty = getattr(torch.nn.functional, f"conv{case[0]}d")(*refs, **kw)
    ty.backward(torch.from_numpy(gy))
    assert allclose(y.data, ty.detach().numpy())
    for t, r in zip(ts, refs):
        assert allclose(t.grad, r.grad.numpy())


@pytest.mark.parametrize("budget", [1, 2000, 20000])
@pytest.mark.parametrize("case", [CASES[9], CASES[3], CASES[7]], ids=["3d-windows", "2d-flat",
                                                                      "3d-flat"])
def test_chunked_unfolding_gives_the_one_chunk_results(xp, monkeypatch, budget, case):
    # budget 1 byte: one output row of one sample per chunk; 2000: a few rows; 20000:
    # whole samples. Backward then rebuilds each chunk instead of keeping it.
    x, w, b, kw = _case(xp, case, batch=3)
    fn = CONV[case[0]]
    results = []
    for limit in (conv.COLS_BYTES, budget):
        monkeypatch.setattr(conv, "COLS_BYTES", limit)
        ts = [Tensor(a, requires_grad=True) for a in (x, w, b)]
        y = fn(*ts, **kw)
        y.backward(_randn(xp, *y.shape, seed=5))
        results.append([y.data] + [t.grad for t in ts])
    per_position = x.shape[1] * int(numpy.prod(w.shape[2:]))
    assert len(conv._chunks(3, y.shape[2:], per_position, 8)) > 1
    for got, want in zip(results[1], results[0]):
        assert allclose(got, want)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_unfolding_geometry_and_gemm_gives_the_same_results(xp, monkeypatch, case):
    # 'Same' layers with stride 1 unfold whole samples as one shifted run per channel
    # (conv.FlatPlanes), or else, with stride 1 on the last two axes, planes as flat runs
    # (conv.FlatRows); the general strided views (conv.Windows) must agree everywhere,
    # as must the forward's GEMM per sample (large maps) and over the batch (small ones).
    x, w, b, kw = _case(xp, case)
    d = case[0]
    stride, dilation = conv.ntuple(kw["stride"], d, "s"), conv.ntuple(kw["dilation"], d, "d")
    geometry = SimpleNamespace(stride=stride, dilation=dilation, pads=conv.conv_padding(
        kw["padding"], w.shape[2:], dilation, stride))
    geometry.out = tuple(conv.output_size(n, k, st, p, dd) for n, k, st, p, dd in zip(
        x.shape[2:], w.shape[2:], stride, geometry.pads, dilation))
    whole = [(0, x.shape[0], 0, geometry.out[0])]
    planes = conv.FlatPlanes.applies(geometry, x.shape, w.shape[2:], whole)
    rows = conv.FlatRows.applies(geometry, x.shape, w.shape[2:])
    results = []
    for mode in ("planes", "rows", "windows"):
        if mode == "rows":
            monkeypatch.setattr(conv.FlatPlanes, "applies", staticmethod(lambda *a: False))
        if mode == "windows":
            monkeypatch.setattr(conv.FlatRows, "applies", staticmethod(lambda *a: False))
            # and the other GEMMs: one per sample for these small maps too
            monkeypatch.setattr(conv, "_PER_SAMPLE_GEMM_FROM", 1)
            monkeypatch.setattr(conv, "_PER_SAMPLE_BACKWARD_FROM", 1)
            monkeypatch.setattr(conv, "_SCRATCH_FROM", 0)  # every chunk in the kept buffer
            monkeypatch.setattr(conv, "KEEP_COLS_BYTES", 0)  # backward unfolds x again
        ts = [Tensor(a, requires_grad=True) for a in (x, w, b)]
        y = CONV[case[0]](*ts, **kw)
        y.backward(_randn(xp, *y.shape, seed=6))
        results.append([y.data] + [t.grad for t in ts])
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            assert allclose(got, want)
    assert planes == (case in (CASES[0], CASES[3], CASES[6], CASES[7], CASES[10]))
    assert rows == (case in (CASES[3], CASES[6], CASES[7], CASES[10]))


@pytest.mark.parametrize("keep", [0, conv.KEEP_COLS_BYTES])
def test_a_second_backward_through_the_graph_gives_the_same_gradients(monkeypatch, keep):
    # Backward writes the input's unfolded gradient over the unfolding kept from
    # forward; a second backward (retain_graph) must unfold x again, not read that.
    monkeypatch.setattr(conv, "KEEP_COLS_BYTES", keep)
    x, w, b, kw = _case(numpy, CASES[3])
    ts = [Tensor(a, requires_grad=True) for a in (x, w, b)]
    y = F.conv2d(*ts, **kw)
    gy = _randn(numpy, *y.shape, seed=7)
    y.backward(gy, retain_graph=True)
    first = [t.grad.copy() for t in ts]
    y.backward(gy)
    for t, g in zip(ts, first):
        assert allclose(t.grad, 2 * g)


def test_chunks_cover_every_output_row_once():
    for batch, out, per, budget in [(5, (7, 3), 4, 100), (2, (9, 2, 2), 3, 10),
                                    (4, (3,), 2, 10**6)]:
        old = conv.COLS_BYTES
        conv.COLS_BYTES = budget
        try:
            chunks = conv._chunks(batch, out, per, 1)
        finally:
            conv.COLS_BYTES = old
        row = per * int(numpy.prod(out[1:]))  # unfolded elements of one output row
        seen = numpy.zeros((batch, out[0]), dtype=int)
        for b0, b1, r0, r1 in chunks:
            seen[b0:b1, r0:r1] += 1
            assert (b1 - b0) * (r1 - r0) * row <= max(budget, row)  # one row at least
        assert (seen == 1).all()


def test_conv_float32_stays_float32_and_an_empty_batch_flows_through(xp):
    x = _randn(xp, 2, 3, 8, 8, seed=6, dtype=numpy.float32)
    w = Tensor(_randn(xp, 4, 3, 3, 3, seed=7, dtype=numpy.float32), requires_grad=True)
    y = F.conv2d(Tensor(x), w, None, padding=1)
    assert y.dtype == numpy.float32 and y.shape == (2, 4, 8, 8)
    ref = reference_conv(x.astype(numpy.float64), w.data.astype(numpy.float64), None,
                         stride=1, padding=1, dilation=1, groups=1)
    assert allclose(y.data, ref.astype(numpy.float32), scale=10)
    # A rank whose share of the global batch is empty still runs forward and backward
    # (one GEMM per sample, or over the whole batch: both must take B = 0).
    conv._PER_SAMPLE_GEMM_FROM, old = 1, conv._PER_SAMPLE_GEMM_FROM
    try:
        assert F.conv2d(Tensor(xp.zeros((0, 3, 8, 8), dtype=numpy.float32)), w).shape[0] == 0
    finally:
        conv._PER_SAMPLE_GEMM_FROM = old
    e = Tensor(xp.zeros((0, 3, 8, 8), dtype=numpy.float32), requires_grad=True)
    b = Tensor(xp.zeros(4, dtype=numpy.float32), requires_grad=True)
    out = F.conv2d(e, w, b, stride=2, padding=1)
    assert out.shape == (0, 4, 4, 4)
    F.sum(out).backward()
    assert e.grad.shape == (0, 3, 8, 8)
    assert not as_numpy(w.grad).any() and not as_numpy(b.grad).any()


@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[8]], ids=["1d-g2", "2d-flat", "3d-g2"])
def test_conv_input_gradient_alone_when_the_weight_is_frozen(xp, case):
    x, w, b, kw = _case(xp, case)
    gy = None
    grads = []
    for frozen in (False, True):
        xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=not frozen)
        y = CONV[case[0]](xt, wt, Tensor(b), **kw)
        gy = _randn(xp, *y.shape, seed=7) if gy is None else gy
        y.backward(gy)
        grads.append(xt.grad)
        assert (wt.grad is None) == frozen
    assert allclose(grads[1], grads[0])


def test_large_unfoldings_share_one_kept_buffer_and_small_ones_do_not(monkeypatch):
    conv.release_scratch()
    small = conv.scratch(numpy, (4, 5), numpy.float32)
    assert getattr(conv._scratch, "buf", None) is None and small.shape == (4, 5)
    monkeypatch.setattr(conv, "_SCRATCH_FROM", 64)
    a = conv.scratch(numpy, (8, 4), numpy.float32)  # 128 bytes: from the buffer
    b = conv.scratch(numpy, (3, 4), numpy.float64)  # 96 bytes: the same buffer
    assert numpy.shares_memory(a, b) and a.dtype == numpy.float32 and b.shape == (3, 4)
    conv.release_scratch()
    assert conv._scratch.buf is None


@pytest.mark.parametrize("per_sample", [False, True])
def test_conv_writes_its_weight_gradient_into_the_grad_buffer(monkeypatch, per_sample):
    if per_sample:
        monkeypatch.setattr(conv, "_PER_SAMPLE_BACKWARD_FROM", 1)
    x, w, b, kw = _case(numpy, CASES[3])
    ts = [Tensor(a, requires_grad=True) for a in (x, w, b)]
    F.conv2d(*ts, **kw).backward(numpy.ones((2, 4, 7, 6)))
    want = ts[1].grad.copy()
    ts[1].grad, ts[1].grad_buffer = None, numpy.full(w.shape, numpy.nan)
    F.conv2d(*ts, **kw).backward(numpy.ones((2, 4, 7, 6)))
    assert ts[1].grad is ts[1].grad_buffer and allclose(ts[1].grad, want)


@pytest.mark.parametrize("call, match", [
    (lambda x, w: F.conv2d(x, w[:, :2]), "input has 3 channels but the weight"),
    (lambda x, w: F.conv2d(x[0], w), r"must be \(B, C\) \+ 2 spatial axes"),
    (lambda x, w: F.conv1d(x, w), "must have 3 dimensions"),
    (lambda x, w: F.conv2d(x, w, stride=0), "must be >= 1"),
    (lambda x, w: F.conv2d(x, w, padding="same", stride=2), "needs stride 1"),
    (lambda x, w: F.conv2d(x, w, padding="full"), "'valid' or 'same'"),
    (lambda x, w: F.conv2d(x, w, dilation=3), "smaller than the dilated kernel"),
    (lambda x, w: F.conv2d(x, w, groups=2), "groups=2 must divide in_channels=3"),
    (lambda x, w: F.conv2d(x, w, stride=(1, 1, 1)), "has 3 entries"),
    (lambda x, w: F.conv2d(x, w, numpy.zeros(3)), r"bias has shape \(3,\), expected \(4,\)"),
])
def test_conv_errors_name_the_values(call, match):
    x, w = numpy.zeros((1, 3, 5, 5)), numpy.zeros((4, 3, 3, 3))
    with pytest.raises(ValueError, match=match):
        call(x, w)


# A step's pattern of allocations: twelve 3 MB arrays (one cnn step's activations, in
# size) filled, then all freed, five times; prints the page faults of the last three.
_HEAP_PROBE = """
import resource, sys, numpy
import mpidl.functions as F
if sys.argv[1] == "conv":
    F.conv2d(numpy.zeros((1, 1, 4, 4)), numpy.zeros((1, 1, 3, 3)))
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    arrays = [numpy.ones(3 << 18, dtype=numpy.float32) for _ in range(12)]
    del arrays
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="glibc's heap")
def test_the_first_convolution_keeps_freed_activations_from_being_faulted_in_again():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    faults = {}
    for mode in ("bare", "conv"):  # ~0.3 s each
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], env=env, check=True,
                             capture_output=True, text=True, timeout=60)
        faults[mode] = int(out.stdout)
    # bare: 36 MB freed each round beyond a 6 MB trim threshold, ~8,000 faults a round
    assert faults["bare"] > 3 * 4000, faults
    assert faults["conv"] < 300, faults
