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


def test_layer_norm_checks_parameter_shapes():
    with pytest.raises(ValueError, match="expected \\(4,\\)"):
        F.layer_norm(Tensor(numpy.zeros((2, 4))), Tensor(numpy.ones(3)))
