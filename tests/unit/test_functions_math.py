"""Arithmetic, matmul and reductions: forward against NumPy, backward against finite
differences (float64), broadcasting, scalar operands, dtype preservation."""
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


BINARY = [
    (F.add, numpy.add),
    (F.sub, numpy.subtract),
    (F.mul, numpy.multiply),
    (F.div, numpy.divide),
]
SHAPES = [((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (4,)), ((3, 1), (2, 1, 5)), ((), (2, 3))]


@pytest.mark.parametrize("op,ref", BINARY, ids=["add", "sub", "mul", "div"])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_binary_ops_broadcast_forward_and_backward(xp, op, ref, shapes):
    a = _randn(xp, *shapes[0], seed=1)
    b = _randn(xp, *shapes[1], seed=2) + (3.0 if op is F.div else 0.0)
    y = op(Tensor(a), Tensor(b))
    assert allclose(y.data, ref(as_numpy(a), as_numpy(b)))
    assert gradcheck(op, [a, b])


def test_python_scalars_work_on_either_side(xp):
    a = _randn(xp, 3, seed=3) + 3.0
    assert gradcheck(lambda t: 2.0 - t, [a])
    assert gradcheck(lambda t: 2.0 / t, [a])
    assert gradcheck(lambda t: t * 3 + 1.5, [a])
    assert gradcheck(lambda t: -t, [a])
    t = Tensor(a)
    assert allclose((2.0 - t).data, 2.0 - as_numpy(a))
    assert allclose((2.0 / t).data, 2.0 / as_numpy(a))


def test_raw_array_operand_gets_no_gradient(xp):
    c = _randn(xp, 2, 3, seed=4)
    x = Tensor(_randn(xp, 3, seed=5), requires_grad=True)
    F.sum(c * x).backward()
    assert allclose(x.grad, as_numpy(c).sum(axis=0))
    assert gradcheck(lambda t: c * t, [_randn(xp, 3, seed=5)])


def test_float32_is_preserved_with_python_and_numpy_scalars(xp):
    x = Tensor(xp.abs(_randn(xp, 4, dtype=numpy.float32)) + 0.5, requires_grad=True)
    for y in (x + 2.0, 2.0 * x, x / 3.0, 1.0 - x, x * numpy.float64(2.0), x ** 2, x ** 0.5):
        assert y.dtype == numpy.float32
    F.sum(x * numpy.float64(2.0)).backward()
    assert x.grad.dtype == numpy.float32


@pytest.mark.parametrize("exponent", [2, 3, 0.5, -1.5])
def test_pow_with_scalar_exponent(xp, exponent):
    a = xp.abs(_randn(xp, 3, 2, seed=6)) + 0.5
    assert allclose(F.pow(Tensor(a), exponent).data, as_numpy(a) ** exponent)
    assert gradcheck(lambda t: t ** exponent, [a])


def test_pow_with_tensor_exponent(xp):
    a = xp.abs(_randn(xp, 3, 2, seed=7)) + 0.5
    p = _randn(xp, 2, seed=8)
    assert allclose(F.pow(Tensor(a), Tensor(p)).data, as_numpy(a) ** as_numpy(p))
    assert gradcheck(F.pow, [a, p])


MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((2, 3, 4), (4, 5)),  # batched @ shared weight
    ((2, 1, 3, 4), (5, 4, 2)),  # leading dims broadcast
    ((4,), (2, 4, 3)),  # 1-D on the left
    ((2, 3, 4), (4,)),  # 1-D on the right
    ((4,), (4,)),  # inner product
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul_batched_and_broadcast(xp, shapes):
    a = _randn(xp, *shapes[0], seed=9)
    b = _randn(xp, *shapes[1], seed=10)
    y = F.matmul(Tensor(a), Tensor(b))
    assert allclose(y.data, numpy.matmul(as_numpy(a), as_numpy(b)))
    assert gradcheck(F.matmul, [a, b])


@pytest.mark.parametrize("axis,keepdims", [(None, False), (0, False), (-1, True), ((0, 2), False),
                                           ((1,), True)])
def test_sum_and_mean(xp, axis, keepdims):
    a = _randn(xp, 2, 3, 4, seed=11)
    for op, ref in ((F.sum, numpy.sum), (F.mean, numpy.mean)):
        y = op(Tensor(a), axis=axis, keepdims=keepdims)
        assert allclose(y.data, ref(as_numpy(a), axis=axis, keepdims=keepdims))
        assert gradcheck(lambda t: op(t, axis=axis, keepdims=keepdims), [a])


def test_tensor_methods_sum_mean(xp):
    a = _randn(xp, 2, 3, seed=12)
    assert allclose(Tensor(a).sum(axis=1).data, as_numpy(a).sum(axis=1))
    assert allclose(Tensor(a).mean().data, as_numpy(a).mean())


def test_exp_and_log(xp):
    a = _randn(xp, 3, 4, seed=13)
    pos = xp.abs(a) + 0.1
    assert allclose(F.exp(Tensor(a)).data, numpy.exp(as_numpy(a)))
    assert allclose(F.log(Tensor(pos)).data, numpy.log(as_numpy(pos)))
    assert gradcheck(F.exp, [a])
    assert gradcheck(F.log, [pos])


def test_sum_to_reduces_broadcast_axes(xp):
    g = xp.ones((2, 3, 4))
    assert F.sum_to(g, (3, 1)).shape == (3, 1)
    assert allclose(F.sum_to(g, (3, 1)), numpy.full((3, 1), 8.0))
    assert allclose(F.sum_to(g, ()), numpy.array(24.0))
    assert F.sum_to(g, (2, 3, 4)) is g
