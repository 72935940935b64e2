"""Activations, erf, softmax/log_softmax and dropout: forward against direct NumPy
formulas, backward against finite differences (float64)."""
from __future__ import annotations

import math

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.testing import allclose
from mpidl.testing.gradcheck import gradcheck

_erf = numpy.vectorize(math.erf)


def _randn(xp, *shape, seed=0, scale=1.0, dtype=numpy.float64):
    a = numpy.random.default_rng(seed).standard_normal(shape) * scale
    return xp.asarray(a.astype(dtype))


def test_erf_float64_matches_math_erf_to_double_precision(xp):
    x = numpy.concatenate([numpy.linspace(-9, 9, 4001), [0.0, 1e-12, -1.0, 1.0, 8.0, 30.0]])
    got = as_numpy(F.erf(xp.asarray(x)))
    numpy.testing.assert_allclose(got, _erf(x), rtol=2e-15, atol=1e-16)


def test_erf_float32_is_accurate_to_a_few_ulp(xp, monkeypatch):
    import mpidl.functions.activation as activation

    monkeypatch.setattr(activation, "_BLOCK", 4096)  # several blocks and a tail
    x = numpy.linspace(-6, 6, 100001).astype(numpy.float32)
    got = F.erf(xp.asarray(x))
    assert got.dtype == numpy.float32
    numpy.testing.assert_allclose(as_numpy(got), _erf(x.astype(numpy.float64)),
                                  rtol=1e-6, atol=1e-7)


def test_relu_tanh_sigmoid_forward(xp):
    a = _randn(xp, 3, 4, seed=1)
    n = as_numpy(a)
    assert allclose(F.relu(Tensor(a)).data, numpy.maximum(n, 0))
    assert allclose(F.tanh(Tensor(a)).data, numpy.tanh(n))
    assert allclose(F.sigmoid(Tensor(a)).data, 1 / (1 + numpy.exp(-n)))


@pytest.mark.parametrize("fn", [F.relu, F.tanh, F.sigmoid], ids=["relu", "tanh", "sigmoid"])
def test_elementwise_activation_gradients(xp, fn):
    a = _randn(xp, 2, 3, 4, seed=2)
    assert gradcheck(fn, [a])


def test_gelu_exact_forward_and_gradient(xp):
    a = _randn(xp, 3, 5, seed=3, scale=2.0)
    n = as_numpy(a)
    assert allclose(F.gelu(Tensor(a)).data, 0.5 * n * (1 + _erf(n / math.sqrt(2))))
    assert gradcheck(F.gelu, [a])


def test_gelu_tanh_forward_and_gradient(xp):
    a = _randn(xp, 3, 5, seed=4, scale=2.0)
    n = as_numpy(a)
    ref = 0.5 * n * (1 + numpy.tanh(math.sqrt(2 / math.pi) * (n + 0.044715 * n ** 3)))
    assert allclose(F.gelu(Tensor(a), approximate="tanh").data, ref)
    assert gradcheck(lambda t: F.gelu(t, approximate="tanh"), [a])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_float32_on_blocked_input_matches_float64(xp, approximate, monkeypatch):
    # Small blocks, so that the blocked loop and its shorter tail are exercised.
    import mpidl.functions.activation as activation

    monkeypatch.setattr(activation, "_BLOCK", 4096)
    a32 = _randn(xp, 70001, seed=5, scale=3.0, dtype=numpy.float32)
    x = Tensor(a32, requires_grad=True)
    y = F.gelu(x, approximate=approximate)
    g = _randn(xp, 70001, seed=6, dtype=numpy.float32)
    assert as_numpy(F.erf(a32)).shape == (70001,)
    y.backward(g)
    x64 = Tensor(a32.astype(numpy.float64), requires_grad=True)
    y64 = F.gelu(x64, approximate=approximate)
    y64.backward(g.astype(numpy.float64))
    assert y.dtype == numpy.float32 and x.grad.dtype == numpy.float32
    assert allclose(y.data, as_numpy(y64.data).astype(numpy.float32), scale=10)
    assert allclose(x.grad, as_numpy(x64.grad).astype(numpy.float32), scale=10)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="tanh"):
        F.gelu(Tensor(numpy.ones(2)), approximate="fast")


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_and_log_softmax(xp, axis):
    a = _randn(xp, 2, 3, 4, seed=7)
    n = as_numpy(a)
    e = numpy.exp(n - n.max(axis=axis, keepdims=True))
    ref = e / e.sum(axis=axis, keepdims=True)
    assert allclose(F.softmax(Tensor(a), axis=axis).data, ref)
    assert allclose(F.log_softmax(Tensor(a), axis=axis).data, numpy.log(ref))
    assert gradcheck(lambda t: F.softmax(t, axis=axis), [a])
    assert gradcheck(lambda t: F.log_softmax(t, axis=axis), [a])


def test_softmax_is_stable_for_large_logits(xp):
    a = xp.asarray(numpy.array([[1000.0, 1001.0, 999.0], [-1000.0, -1000.0, -1000.0]],
                               dtype=numpy.float32))
    y = as_numpy(F.softmax(Tensor(a)).data)
    assert numpy.all(numpy.isfinite(y))
    numpy.testing.assert_allclose(y.sum(axis=-1), 1.0, rtol=1e-6)
    assert numpy.all(numpy.isfinite(as_numpy(F.log_softmax(Tensor(a)).data)))


def test_dropout_is_deterministic_for_a_seed_and_scales_kept_values(xp):
    a = xp.ones((1000,), dtype=numpy.float32)
    y1 = as_numpy(F.dropout(Tensor(a), 0.25, rng=123).data)
    y2 = as_numpy(F.dropout(Tensor(a), 0.25, rng=123).data)
    numpy.testing.assert_array_equal(y1, y2)
    assert y1.dtype == numpy.float32
    assert set(numpy.unique(y1)) <= {0.0, numpy.float32(1 / 0.75)}
    assert 0.15 < (y1 == 0).mean() < 0.35


def test_dropout_generators_advance_and_gradient_uses_the_same_mask(xp):
    rng = numpy.random.default_rng(0)
    a = _randn(xp, 50, seed=8)
    x = Tensor(a, requires_grad=True)
    y = F.dropout(x, 0.5, rng=rng)
    F.sum(y).backward()
    mask = as_numpy(y.data) / as_numpy(a)
    numpy.testing.assert_allclose(as_numpy(x.grad), mask)
    y2 = F.dropout(Tensor(a), 0.5, rng=rng)
    assert not numpy.array_equal(as_numpy(y2.data), as_numpy(y.data))


def test_dropout_in_evaluation_or_with_p_zero_is_identity(xp):
    a = _randn(xp, 5, seed=9)
    assert F.dropout(Tensor(a), 0.5, training=False).data is a
    assert F.dropout(Tensor(a), 0.0).data is a
    with pytest.raises(ValueError, match="p=1"):
        F.dropout(Tensor(a), 1.0)


def test_dropout_gradient(xp):
    a = _randn(xp, 4, 3, seed=10)
    # The same seed each call: the same mask in every finite-difference evaluation.
    assert gradcheck(lambda t: F.dropout(t, 0.3, rng=7), [a])


def test_a_host_generator_gives_one_seed_per_dropout_call_whatever_the_shape(xp):
    # The checkpointed host state advances by one draw per call, so the mask can be
    # drawn on the device (from that seed) and a resume still continues exactly.
    small, large = numpy.random.default_rng(4), numpy.random.default_rng(4)
    F.dropout(Tensor(xp.ones(3)), 0.5, rng=small)
    F.dropout(Tensor(xp.ones((64, 100))), 0.5, rng=large)
    assert small.bit_generator.state == large.bit_generator.state


def test_the_dropout_mask_comes_from_the_calls_seed(xp):
    from mpidl.backend import uniform_from_seed
    from mpidl.functions.dropout import call_seed

    rng = numpy.random.default_rng(11)
    twin = numpy.random.default_rng(11)
    y = F.dropout(Tensor(xp.ones((8, 9), dtype=numpy.float32)), 0.4, rng=rng)
    keep = as_numpy(uniform_from_seed(xp, call_seed(twin), (8, 9))) >= 0.4
    numpy.testing.assert_array_equal(as_numpy(y.data) != 0, keep)


def test_dropout_resumes_exactly_from_the_checkpointed_host_state(xp):
    from mpidl.nn import Dropout

    x = Tensor(xp.ones((16, 16), dtype=numpy.float32))
    run = Dropout(0.5, seed=3)
    for _ in range(2):
        run(x)
    saved = run.rng.bit_generator.state  # what RunCheckpoints.rng_states checkpoints
    after = [as_numpy(run(x).data) for _ in range(2)]
    resumed = Dropout(0.5, seed=99)
    resumed.rng.bit_generator.state = saved
    for expected in after:
        numpy.testing.assert_array_equal(as_numpy(resumed(x).data), expected)


@pytest.mark.parametrize("slope", [0.01, 0.2, -0.5])
def test_leaky_relu_forward_and_gradient(xp, slope):
    a = _randn(xp, 3, 4, 5, seed=11)
    n = as_numpy(a)
    assert allclose(F.leaky_relu(Tensor(a), slope).data, numpy.where(n > 0, n, slope * n))
    assert gradcheck(lambda t: F.leaky_relu(t, slope), [a])
    assert F.leaky_relu(Tensor(a.astype(numpy.float32))).dtype == numpy.float32
