"""``Function.owned_grads``: a leaf adopts a fresh gradient array instead of copying it,
never when the array is shared, and accumulation into a preset ``.grad`` (data
parallelism's bucket views) stays in place."""
from __future__ import annotations

import numpy

from mpidl.autograd import Function, Tensor


class _Twice(Function):
    """y = a + b, returning the SAME array for both inputs and claiming it as owned."""

    owned_grads = (0, 1)

    def forward(self, a, b):
        return a + b

    def backward(self, gy):
        g = gy.copy()
        return g, g


class _Fresh(Function):
    """y = 3 x with a fresh, owned gradient; records the array it returned."""

    owned_grads = (0,)
    returned: list = []

    def forward(self, x):
        return 3 * x

    def backward(self, gy):
        g = 3 * gy
        _Fresh.returned.append(g)
        return g


def test_owned_fresh_gradient_is_adopted_without_a_copy():
    _Fresh.returned.clear()
    x = Tensor(numpy.ones(4), requires_grad=True)
    _Fresh.apply(x).backward(numpy.ones(4))
    assert x.grad is _Fresh.returned[0]
    numpy.testing.assert_array_equal(x.grad, 3.0)


def test_the_same_array_for_two_inputs_is_never_aliased():
    a = Tensor(numpy.zeros(3), requires_grad=True)
    b = Tensor(numpy.zeros(3), requires_grad=True)
    _Twice.apply(a, b).backward(numpy.ones(3))
    assert a.grad is not b.grad and not numpy.shares_memory(a.grad, b.grad)
    a.grad += 1  # must not change b's gradient
    numpy.testing.assert_array_equal(b.grad, 1.0)


def test_same_leaf_twice_accumulates_into_the_adopted_array():
    x = Tensor(numpy.ones(2), requires_grad=True)
    y = _Fresh.apply(x) + _Fresh.apply(x)
    y.backward(numpy.ones(2))
    numpy.testing.assert_array_equal(x.grad, 6.0)


def test_preset_grad_is_accumulated_in_place():
    bucket = numpy.zeros(6)
    x = Tensor(numpy.ones(3), requires_grad=True)
    x.grad = bucket[2:5]  # a view into a flat bucket, as data parallelism sets it
    _Fresh.apply(x).backward(numpy.ones(3))
    numpy.testing.assert_array_equal(bucket, [0, 0, 3, 3, 3, 0])
    assert x.grad.base is bucket


def test_dtype_mismatch_is_copied_to_the_leaf_dtype():
    class Wide(_Fresh):
        def backward(self, gy):
            return (3 * gy).astype(numpy.float64)

    x = Tensor(numpy.ones(2, numpy.float32), requires_grad=True)
    Wide.apply(x).backward(numpy.ones(2, numpy.float32))
    assert x.grad.dtype == numpy.float32
