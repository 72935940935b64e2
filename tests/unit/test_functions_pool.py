"""Pooling: forward against a direct loop over windows, backward against finite
differences (float64), both against PyTorch's pooling when it is installed; ties (whole
windows of zeros after a ReLU) send the gradient to the first maximum only."""
from __future__ import annotations

import itertools

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.functions.pool import adaptive_windows
from mpidl.testing import allclose
from mpidl.testing.gradcheck import gradcheck

MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
ADAPTIVE = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
SIZES = {1: (9,), 2: (7, 8), 3: (5, 6, 7)}
# (kernel, stride, padding, dilation)
WINDOWS = [(2, None, 0, 1), (3, 2, 1, 1), (3, 1, 1, 2), (2, 1, 0, 1), (3, 3, 0, 1)]
IDS = [f"k{k}-s{s}-p{p}-d{d}" for k, s, p, d in WINDOWS]


def _randn(xp, *shape, seed=0):
    return xp.asarray(numpy.random.default_rng(seed).standard_normal(shape))


def _windows(x, kernel, stride, padding, dilation, fill):
    """Yield (output position, window values (B, C, K)) of the padded input."""
    d = x.ndim - 2
    k, s = (kernel,) * d, (stride or kernel,) * d
    p, dl = (padding,) * d, (dilation,) * d
    xpad = numpy.pad(x, [(0, 0), (0, 0)] + [(q, q) for q in p], constant_values=fill)
    out = [(n + 2 * q - dd * (kk - 1) - 1) // ss + 1 for n, kk, ss, q, dd in
           zip(x.shape[2:], k, s, p, dl)]
    for pos in itertools.product(*(range(n) for n in out)):
        sl = tuple(slice(i * ss, i * ss + dd * (kk - 1) + 1, dd)
                   for i, ss, dd, kk in zip(pos, s, dl, k))
        yield pos, out, xpad[(slice(None), slice(None)) + sl].reshape(x.shape[:2] + (-1,))


def reference_pool(x, kernel, stride, padding, dilation=1, kind="max", include_pad=True):
    x = as_numpy(x)
    fill = -numpy.inf if kind == "max" else 0.0
    y = None
    ones = numpy.ones((1, 1) + x.shape[2:])
    counts = dict((pos, v.sum()) for pos, _, v in
                  _windows(ones, kernel, stride, padding, dilation, 0.0))
    for pos, out, v in _windows(x, kernel, stride, padding, dilation, fill):
        if y is None:
            y = numpy.zeros(x.shape[:2] + tuple(out))
        if kind == "max":
            y[(slice(None), slice(None)) + pos] = v.max(axis=-1)
        else:
            div = v.shape[-1] if include_pad else counts[pos]
            y[(slice(None), slice(None)) + pos] = v.sum(axis=-1) / div
    return y


def reference_adaptive(x, out):
    x = as_numpy(x)
    d = x.ndim - 2
    y = numpy.zeros(x.shape[:2] + tuple(out))
    for pos in itertools.product(*(range(p) for p in out)):
        sl = tuple(slice(*adaptive_windows(n, p)[i]) for i, n, p in zip(pos, x.shape[2:], out))
        y[(slice(None), slice(None)) + pos] = x[(slice(None), slice(None)) + sl].mean(
            axis=tuple(range(2, 2 + d)))
    return y


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("window", WINDOWS, ids=IDS)
def test_max_pool_matches_the_definition_and_finite_differences(xp, d, window):
    k, s, p, dl = window
    x = _randn(xp, 2, 2, *SIZES[d], seed=d)  # distinct values: differentiable everywhere
    y = MAX[d](Tensor(x), k, s, p, dl)
    assert allclose(y.data, reference_pool(x, k, s, p, dl, "max"))
    assert gradcheck(lambda t: MAX[d](t, k, s, p, dl), [x])


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("window", [w for w in WINDOWS if w[3] == 1],
                         ids=lambda w: f"k{w[0]}-s{w[1]}-p{w[2]}")
@pytest.mark.parametrize("include_pad", [True, False])
def test_avg_pool_matches_the_definition_and_finite_differences(xp, d, window, include_pad):
    k, s, p, _ = window
    x = _randn(xp, 2, 2, *SIZES[d], seed=d)
    y = AVG[d](Tensor(x), k, s, p, count_include_pad=include_pad)
    assert allclose(y.data, reference_pool(x, k, s, p, 1, "avg", include_pad))
    assert gradcheck(lambda t: AVG[d](t, k, s, p, count_include_pad=include_pad), [x])


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("out", [1, 2, 3, 4])
def test_adaptive_avg_pool_matches_its_windows_and_finite_differences(xp, d, out):
    x = _randn(xp, 2, 3, *SIZES[d], seed=d + 3)
    y = ADAPTIVE[d](Tensor(x), out)
    assert y.shape == (2, 3) + (out,) * d
    assert allclose(y.data, reference_adaptive(x, (out,) * d))
    assert gradcheck(lambda t: ADAPTIVE[d](t, out), [x])


def test_adaptive_windows_are_pytorchs_and_none_keeps_an_axis(xp):
    assert adaptive_windows(7, 3) == [(0, 3), (2, 5), (4, 7)]
    assert adaptive_windows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    x = _randn(xp, 1, 2, 5, 6)
    y = F.adaptive_avg_pool2d(Tensor(x), (None, 2))
    assert y.shape == (1, 2, 5, 2) and allclose(y.data, reference_adaptive(x, (5, 2)))


def test_max_pool_ties_send_the_gradient_to_the_first_maximum_and_nan_wins(xp):
    x = Tensor(xp.asarray([[[0.0, 0.0, 3.0, 3.0, -1.0, 2.0]]]), requires_grad=True)
    y = F.max_pool1d(x, 2)
    F.sum(y).backward()
    numpy.testing.assert_array_equal(as_numpy(x.grad), [[[1, 0, 1, 0, 0, 1]]])
    z = F.max_pool1d(Tensor(xp.asarray([[[1.0, numpy.nan, 5.0, 2.0]]])), 2)
    assert numpy.isnan(as_numpy(z.data)[0, 0, 0]) and as_numpy(z.data)[0, 0, 1] == 5.0


@pytest.mark.extra("torch")
@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("window", WINDOWS, ids=IDS)
def test_pooling_matches_pytorch_forward_and_backward(d, window):
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    k, s, p, dl = window
    x = numpy.maximum(_randn(numpy, 3, 2, *SIZES[d], seed=7), 0)  # ReLU-like: many ties
    gy = None
    cases = [(lambda t: MAX[d](t, k, s, p, dl),
              lambda t: getattr(tf, f"max_pool{d}d")(t, k, s, p, dl))]
    if dl == 1:
        for inc in (True, False):
            cases.append((lambda t, inc=inc: AVG[d](t, k, s, p, count_include_pad=inc),
                          lambda t, inc=inc: getattr(tf, f"avg_pool{d}d")(
                              t, k, s, p, count_include_pad=inc)))
    cases.append((lambda t: ADAPTIVE[d](t, 3),
                  lambda t: getattr(tf, f"adaptive_avg_pool{d}d")(t, 3)))
    for ours, theirs in cases:
        xt = Tensor(x, requires_grad=True)
        y = ours(xt)
        gy = numpy.random.default_rng(8).standard_normal(y.shape)
        y.backward(gy)
        tx = torch.tensor(x, requires_grad=True)
        ty = theirs(tx)
        ty.backward(torch.from_numpy(gy))
        assert allclose(y.data, ty.detach().numpy())
        assert allclose(xt.grad, tx.grad.numpy())


def test_pooling_float32_and_an_empty_batch(xp):
    x = Tensor(xp.zeros((0, 3, 8, 8), dtype=numpy.float32), requires_grad=True)
    for fn in (lambda t: F.max_pool2d(t, 2), lambda t: F.avg_pool2d(t, 3, 2, 1),
               lambda t: F.adaptive_avg_pool2d(t, 1), lambda t: F.adaptive_avg_pool2d(t, 3)):
        y = fn(x)
        assert y.dtype == numpy.float32 and y.shape[0] == 0
        F.sum(y).backward()
        assert x.grad.shape == x.shape
        x.grad = None


@pytest.mark.parametrize("call, match", [
    (lambda x: F.max_pool2d(x[0], 2), "must have 4 dimensions"),
    (lambda x: F.max_pool2d(x, 2, padding=2), "at most half of kernel_size"),
    (lambda x: F.avg_pool2d(x, 7), "smaller than the window"),
    (lambda x: F.max_pool2d(x, 0), "must be >= 1"),
    (lambda x: F.adaptive_avg_pool2d(x, (2, 2, 2)), "has 3 entries"),
])
def test_pooling_errors_name_the_values(call, match):
    with pytest.raises(ValueError, match=match):
        call(numpy.zeros((1, 2, 5, 5)))


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_with_a_different_window_per_axis(xp, kind):
    # A 1-wide axis with stride 2 (a pass that only subsamples), and one padded 3-wide.
    x = _randn(xp, 2, 2, 7, 6, seed=9)
    args = dict(kernel_size=(1, 3), stride=(2, 1), padding=(0, 1))
    fn = F.max_pool2d if kind == "max" else F.avg_pool2d
    y = fn(Tensor(x), **args)
    want = as_numpy(x)[:, :, ::2]
    pad = numpy.pad(want, [(0, 0)] * 3 + [(1, 1)],
                    constant_values=-numpy.inf if kind == "max" else 0.0)
    windows = numpy.stack([pad[..., j:j + 6] for j in range(3)])
    assert allclose(y.data, windows.max(axis=0) if kind == "max" else windows.mean(axis=0))
    assert gradcheck(lambda t: fn(t, **args), [x])


def test_max_pool_with_a_stride_beyond_the_window_reads_every_window(xp):
    # Windows 2 wide every 3: the last one ends one short of the map, but the windows do
    # not tile the part they read (the gaps between them), so it is pooled as it is.
    x = _randn(xp, 2, 2, 8, 9, seed=9)
    y = F.max_pool2d(Tensor(x), 2, 3)
    assert allclose(y.data, reference_pool(x, 2, 3, 0, 1, "max"))
    assert gradcheck(lambda t: F.max_pool2d(t, 2, 3), [x])
