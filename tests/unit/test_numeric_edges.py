"""Values where a naive formula loses its digits, its sign, or overflows.

References are float64 closed forms (math.erf, math.exp), not another framework.
"""
from __future__ import annotations

import math

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor
from mpidl.optim import clip_grad_norm_


def _gelu64(x):
    return x * 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def test_sigmoid_keeps_its_digits_for_negative_inputs():
    xs = numpy.array([-10.0, -17.0, -20.0, -30.0], dtype=numpy.float32)
    y = F.sigmoid(Tensor(xs)).data
    ref = numpy.array([1.0 / (1.0 + math.exp(-float(v))) for v in xs])
    assert y.dtype == numpy.float32
    numpy.testing.assert_allclose(y, ref, rtol=1e-6)  # 0.5 (1 + tanh) gave 0 at -20
    x = Tensor(xs, requires_grad=True)
    F.sum(F.log(F.sigmoid(x))).backward()  # finite: log of a positive number
    numpy.testing.assert_allclose(x.grad, 1.0 - ref, rtol=1e-5)
    big = F.sigmoid(Tensor(numpy.array([-40.0, 40.0]))).data
    numpy.testing.assert_allclose(big, [1.0 / (1.0 + math.exp(40.0)), 1.0], rtol=1e-12)


def test_exact_gelu_is_never_positive_for_negative_float32_inputs():
    xs = numpy.array([-6.0, -10.0, -100.0, -1e6, -3.0], dtype=numpy.float32)
    x = Tensor(xs, requires_grad=True)
    y = F.gelu(x)
    assert numpy.all(y.data <= 0), y.data  # the CDF's rounding below 0 made them positive
    numpy.testing.assert_allclose(y.data, [_gelu64(float(v)) for v in xs], atol=1e-6)
    F.sum(y).backward()
    assert numpy.all(numpy.abs(x.grad[:4]) < 1e-6), x.grad


def test_float16_gelu_is_computed_in_float32():
    xs = numpy.array([-4.0, -3.5, -3.0, -2.5], dtype=numpy.float16)
    y = F.gelu(Tensor(xs)).data
    assert y.dtype == numpy.float16
    ref = numpy.array([_gelu64(float(v)) for v in xs])
    numpy.testing.assert_allclose(y.astype(numpy.float64), ref, rtol=2e-3)  # was 8% off
    x = Tensor(numpy.array([-300.0, 300.0], dtype=numpy.float16), requires_grad=True)
    F.sum(F.gelu(x, approximate="tanh")).backward()  # x * x overflowed float16: NaN
    assert x.grad.dtype == numpy.float16 and x.grad.tolist() == [0.0, 1.0]


def test_float16_layer_norm_does_not_overflow_its_variance():
    rng = numpy.random.default_rng(0)
    x64 = rng.standard_normal((2, 1024)) * 10  # float16 sum of squares: inf
    x = Tensor(x64.astype(numpy.float16), requires_grad=True)
    y = F.layer_norm(x)
    ref = (x64 - x64.mean(-1, keepdims=True)) / numpy.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    assert y.data.dtype == numpy.float16
    numpy.testing.assert_allclose(y.data.astype(numpy.float64), ref, atol=2e-2)
    F.sum(y * Tensor(ref.astype(numpy.float16))).backward()
    assert x.grad.dtype == numpy.float16 and numpy.isfinite(x.grad).all()
    assert numpy.abs(x.grad).max() > 0


def test_clip_grad_norm_of_float16_gradients_sums_squares_without_overflow():
    p = Tensor(numpy.zeros(1000, numpy.float16), requires_grad=True)
    p.grad = numpy.full(1000, 10.0, numpy.float16)  # norm 316: squares sum to 1e5 > 65504
    norm = clip_grad_norm_([p], max_norm=1000.0)
    assert float(norm) == pytest.approx(math.sqrt(1000) * 10, rel=1e-3)
    assert p.grad.dtype == numpy.float16 and numpy.all(p.grad == 10.0)  # not clipped
    clip_grad_norm_([p], max_norm=31.6227766)
    numpy.testing.assert_allclose(p.grad.astype(numpy.float64), 1.0, rtol=2e-3)


def test_pow_gradients_at_zero_are_those_of_the_limit():
    x = Tensor(numpy.array([0.0, 2.0]), requires_grad=True)
    F.sum(F.pow(x, 0)).backward()  # x**0 is constant 1
    assert x.grad.tolist() == [0.0, 0.0]
    x = Tensor(numpy.array([0.0, 1.0]), requires_grad=True)
    p = Tensor(numpy.array(2.0), requires_grad=True)
    F.sum(F.pow(x, p)).backward()  # d/dp: 0**2 log 0 -> 0, 1**2 log 1 = 0
    assert float(p.grad) == 0.0 and x.grad.tolist() == [0.0, 2.0]
