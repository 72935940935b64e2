"""layer_norm: forward against the textbook formula, fused backward against finite
differences, with and without affine parameters."""
from __future__ import annotations

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.testing import allclose
from mpidl.testing.gradcheck import gradcheck


def _randn(xp, *shape, seed=0, dtype=numpy.float64):
    return xp.asarray(numpy.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _reference(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mu) / numpy.sqrt(var + eps)
    return y * (1 if w is None else w) + (0 if b is None else b)


@pytest.mark.parametrize("shape", [(4, 6), (2, 3, 5)])
def test_layer_norm_forward_and_backward(xp, shape):
    x = _randn(xp, *shape, seed=1)
    w = _randn(xp, shape[-1], seed=2)
    b = _randn(xp, shape[-1], seed=3)
    y = F.layer_norm(Tensor(x), Tensor(w), Tensor(b), eps=1e-5)
    assert allclose(y.data, _reference(as_numpy(x), as_numpy(w), as_numpy(b), 1e-5))
    assert gradcheck(lambda *ts: F.layer_norm(*ts, eps=1e-5), [x, w, b])


def test_layer_norm_without_affine_parameters(xp):
    x = _randn(xp, 3, 7, seed=4)
    y = F.layer_norm(Tensor(x))
    assert allclose(y.data, _reference(as_numpy(x), None, None, 1e-5))
    assert gradcheck(lambda t: F.layer_norm(t), [x])


def test_layer_norm_float32(xp):
    x = _randn(xp, 8, 16, seed=5, dtype=numpy.float32) * 3 + 1
    w = Tensor(_randn(xp, 16, seed=6, dtype=numpy.float32), requires_grad=True)
    b = Tensor(_randn(xp, 16, seed=7, dtype=numpy.float32), requires_grad=True)
    y = F.layer_norm(Tensor(x), w, b)
    assert y.dtype == numpy.float32
    ref = _reference(as_numpy(x).astype(numpy.float64), as_numpy(w.data), as_numpy(b.data), 1e-5)
    assert allclose(y.data, ref.astype(numpy.float32), scale=10)
    F.sum(y).backward()
    assert w.grad.dtype == numpy.float32 and b.grad.dtype == numpy.float32


@pytest.mark.parametrize("affine", ["weight", "bias"])
def test_layer_norm_with_one_affine_parameter_and_a_strided_input(xp, affine):
    x = xp.swapaxes(_randn(xp, 5, 3, seed=8), 0, 1)  # (3, 5), not C-contiguous
    p = _randn(xp, 5, seed=9)

    def fn(a, q):
        return F.layer_norm(a, *((q, None) if affine == "weight" else (None, q)))

    w, b = (p, None) if affine == "weight" else (None, p)
    y = fn(Tensor(x), Tensor(p))
    ref = _reference(as_numpy(x), None if w is None else as_numpy(w),
                     None if b is None else as_numpy(b), 1e-5)
    assert allclose(y.data, ref)
    assert gradcheck(fn, [x, p])
    # The strided input gives the gradients of its contiguous copy.
    xc = xp.ascontiguousarray(x)
    g = _randn(xp, 3, 5, seed=10)
    grads = []
    for a in (x, xc):
        ts = [Tensor(a, requires_grad=True), Tensor(p, requires_grad=True)]
        fn(*ts).backward(g)
        grads.append([as_numpy(t.grad) for t in ts])
    for got, want in zip(*grads):
        assert allclose(got, want)


def test_layer_norm_float32_gradients_match_float64_with_a_large_mean(xp):
    # Rows far from zero (mean 50 x std): the centred two-pass forms keep float32 exact
    # enough; 97 rows (prime) also leave the row-vector tiling its fallback path.
    x = _randn(xp, 97, 48, seed=10) + 50.0
    w, b, g = _randn(xp, 48, seed=11), _randn(xp, 48, seed=12), _randn(xp, 97, 48, seed=13)
    grads = []
    for dtype in (numpy.float32, numpy.float64):
        ts = [Tensor(a.astype(dtype), requires_grad=True) for a in (x, w, b)]
        F.layer_norm(*ts).backward(g.astype(dtype))
        grads.append([as_numpy(t.grad) for t in ts])
    for g32, g64 in zip(*grads):
        assert allclose(g32, g64.astype(numpy.float32), scale=10)


def test_layer_norm_checks_parameter_shapes():
    with pytest.raises(ValueError, match="expected \\(4,\\)"):
        F.layer_norm(Tensor(numpy.zeros((2, 4))), Tensor(numpy.ones(3)))
