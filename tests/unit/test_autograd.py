"""The autograd engine: graph walking, accumulation, hooks, no_grad, freeing; gradcheck."""
from __future__ import annotations

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Function, Tensor, no_grad
from mpidl.testing.gradcheck import gradcheck, numerical_grad


def _leaf(xp, *shape, seed=0, dtype=numpy.float64):
    rng = numpy.random.default_rng(seed)
    return Tensor(xp.asarray(rng.standard_normal(shape).astype(dtype)), requires_grad=True)


def test_shared_subexpression_accumulates_both_uses(xp):
    x = _leaf(xp, 3)
    y = x * x + x  # x is used three times, through two functions
    y.sum().backward()
    numpy.testing.assert_allclose(x.grad.get() if xp is not numpy else x.grad,
                                  2 * (x.numpy()) + 1)


def test_diamond_graph_runs_each_function_once():
    calls = []

    class Count(Function):
        def forward(self, x):
            return x * 1.0

        def backward(self, gy):
            calls.append(1)
            return gy

    x = Tensor(numpy.ones(3), requires_grad=True)
    a = Count.apply(x)
    y = F.mul(a, 2.0) + F.mul(a, 3.0)
    y.sum().backward()
    assert len(calls) == 1
    numpy.testing.assert_allclose(x.grad, numpy.full(3, 5.0))


def test_no_grad_records_no_graph():
    x = Tensor(numpy.ones(3), requires_grad=True)
    with no_grad():
        y = x * 2
    assert y.creator is None and not y.requires_grad
    z = x * 2
    assert z.creator is not None and z.requires_grad


def test_constants_get_no_gradient():
    x = Tensor(numpy.ones(3), requires_grad=True)
    c = Tensor(numpy.full(3, 2.0))
    (x * c).sum().backward()
    assert c.grad is None
    numpy.testing.assert_allclose(x.grad, numpy.full(3, 2.0))


def test_gradients_accumulate_across_backward_calls():
    x = Tensor(numpy.ones(2), requires_grad=True)
    (x * 3.0).sum().backward()
    (x * 3.0).sum().backward()
    numpy.testing.assert_allclose(x.grad, numpy.full(2, 6.0))


def test_a_gradient_arrives_in_the_leafs_grad_buffer_then_adds_there():
    x = Tensor(numpy.ones(3), requires_grad=True)
    home = numpy.full(5, 7.0)
    x.grad_buffer = home[1:4]  # as DataParallel's buckets set it
    (x * 2.0).sum().backward()
    assert x.grad is x.grad_buffer and list(home) == [7, 2, 2, 2, 7]
    (x * 3.0).sum().backward()
    assert x.grad.base is home and list(home) == [7, 5, 5, 5, 7]
    x.grad = None  # zero_grad(): the next gradient overwrites the stale values
    (x * 1.0).sum().backward()
    assert x.grad.base is home and list(home) == [7, 1, 1, 1, 7]


def test_post_accumulate_hook_fires_once_with_the_final_gradient():
    w = Tensor(numpy.array([1.0, 2.0]), requires_grad=True)
    b = Tensor(numpy.array([0.5]), requires_grad=True)
    seen = {}

    def hook(t):
        seen.setdefault(t.name, []).append(t.grad.copy())

    w.name, b.name = "w", "b"
    w.register_post_accumulate_grad_hook(hook)
    b.register_post_accumulate_grad_hook(hook)
    # w reaches the loss along three paths of different depths.
    h = F.tanh(w * 2.0) + b
    loss = F.sum(h * w) + F.sum(w * w) + F.sum(F.exp(h))
    loss.backward()
    assert len(seen["w"]) == 1 and len(seen["b"]) == 1
    numpy.testing.assert_array_equal(seen["w"][0], w.grad)
    numpy.testing.assert_array_equal(seen["b"][0], b.grad)
    # A second backward fires again, once, with the accumulated gradient.
    loss2 = F.sum(w * 3.0)
    loss2.backward()
    assert len(seen["w"]) == 2 and len(seen["b"]) == 1
    numpy.testing.assert_array_equal(seen["w"][1], w.grad)


def test_hook_handle_remove_stops_the_hook():
    w = Tensor(numpy.ones(2), requires_grad=True)
    calls = []
    handle = w.register_post_accumulate_grad_hook(lambda t: calls.append(1))
    F.sum(w * 2.0).backward()
    handle.remove()
    F.sum(w * 2.0).backward()
    assert calls == [1]


def test_hook_does_not_fire_for_a_leaf_that_got_no_gradient_this_pass():
    w = Tensor(numpy.ones(2), requires_grad=True)
    v = Tensor(numpy.ones(2), requires_grad=True)
    F.sum(w * v).backward()  # both get a .grad
    calls = []
    v.register_post_accumulate_grad_hook(lambda t: calls.append(1))

    class OnlyFirst(Function):
        def forward(self, a, b):
            return a + b

        def backward(self, gy):
            return gy, None

    F.sum(OnlyFirst.apply(w, v)).backward()
    assert calls == []


def test_backward_twice_through_a_freed_graph_raises():
    x = Tensor(numpy.ones(2), requires_grad=True)
    y = F.sum(F.exp(x))
    y.backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        y.backward()


def test_retain_graph_allows_a_second_backward():
    x = Tensor(numpy.array([0.5, -1.0]), requires_grad=True)
    y = F.sum(F.exp(x))
    y.backward(retain_graph=True)
    first = x.grad.copy()
    y.backward()
    numpy.testing.assert_allclose(x.grad, 2 * first)


def test_backward_needs_a_gradient_for_non_scalars():
    x = Tensor(numpy.ones(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar"):
        (x * 2).backward()


def test_float32_stays_float32_through_ops_and_gradients(xp):
    x = _leaf(xp, 4, 5, dtype=numpy.float32)
    w = _leaf(xp, 5, 3, seed=1, dtype=numpy.float32)
    b = _leaf(xp, 3, seed=2, dtype=numpy.float32)
    h = F.gelu(x @ w + b) * 2.0 - 1.0
    h = F.layer_norm(h / 3.0, None, None) ** 2
    loss = F.softmax_cross_entropy(h, xp.asarray([0, 1, 2, 0]))
    assert h.dtype == numpy.float32 and loss.dtype == numpy.float32
    loss.backward()
    for t in (x, w, b):
        assert t.grad.dtype == numpy.float32


def test_ndarray_operands_on_the_left_defer_to_tensor():
    x = Tensor(numpy.ones(3, dtype=numpy.float32), requires_grad=True)
    y = numpy.full(3, 2.0, dtype=numpy.float32) * x
    z = numpy.float32(3.0) - x
    assert isinstance(y, Tensor) and isinstance(z, Tensor)
    F.sum(y + z).backward()
    numpy.testing.assert_allclose(x.grad, numpy.full(3, 1.0))


def test_gradcheck_catches_a_wrong_backward():
    class WrongSquare(Function):
        def forward(self, x):
            self.x = x
            return x * x

        def backward(self, gy):
            return gy * self.x  # should be 2 x

    with pytest.raises(AssertionError, match="worst at"):
        gradcheck(lambda x: WrongSquare.apply(x), [numpy.array([1.0, 2.0, 3.0])])


def test_numerical_grad_of_a_quadratic():
    x = numpy.array([1.0, -2.0])
    g = numerical_grad(lambda t: F.sum(t * t), [x], grad_outputs=[numpy.array(1.0)])
    numpy.testing.assert_allclose(g[0], 2 * x, rtol=1e-8)


def test_gradcheck_leaves_integer_inputs_alone():
    labels = numpy.array([1, 0])
    assert gradcheck(lambda x, t: F.softmax_cross_entropy(x, t),
                     [numpy.random.default_rng(0).standard_normal((2, 3)), labels])


def test_numerical_grad_perturbs_a_strided_input_in_place():
    x = numpy.arange(6.0).reshape(2, 3).T  # (3, 2), not C-contiguous
    w = numpy.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    got = numerical_grad(lambda a: F.sum(a * Tensor(w)), [x], grad_outputs=[numpy.array(1.0)])
    numpy.testing.assert_allclose(got[0], w, rtol=1e-6)
