"""softmax_cross_entropy (mean / sum / none, ignore_index) and mean_squared_error."""
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


def _reference(logits, labels, ignore_index=None, reduction="mean"):
    x = logits.reshape(-1, logits.shape[-1])
    t = labels.reshape(-1)
    logp = x - x.max(axis=1, keepdims=True)
    logp = logp - numpy.log(numpy.exp(logp).sum(axis=1, keepdims=True))
    valid = numpy.ones(t.shape, bool) if ignore_index is None else t != ignore_index
    safe = numpy.where(valid, t, 0)
    nll = -logp[numpy.arange(len(t)), safe] * valid
    if reduction == "none":
        return nll.reshape(labels.shape)
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / max(valid.sum(), 1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_log_softmax_formula(xp, reduction):
    logits = _randn(xp, 6, 5, seed=1)
    labels = xp.asarray([0, 4, 2, 2, 1, 3])
    y = F.softmax_cross_entropy(Tensor(logits), labels, reduction=reduction)
    assert allclose(y.data, _reference(as_numpy(logits), as_numpy(labels), reduction=reduction))
    assert gradcheck(lambda t: F.softmax_cross_entropy(t, labels, reduction=reduction), [logits])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_ignore_index_on_batched_logits(xp, reduction):
    logits = _randn(xp, 2, 4, 3, seed=2)  # (B, T, C)
    labels = xp.asarray([[0, -100, 2, 1], [-100, -100, 1, 0]])
    y = F.softmax_cross_entropy(Tensor(logits), labels, ignore_index=-100, reduction=reduction)
    ref = _reference(as_numpy(logits), as_numpy(labels), ignore_index=-100, reduction=reduction)
    assert allclose(y.data, ref)
    assert gradcheck(
        lambda t: F.softmax_cross_entropy(t, labels, ignore_index=-100, reduction=reduction),
        [logits])
    # Ignored positions get exactly zero gradient.
    x = Tensor(logits, requires_grad=True)
    F.sum(F.softmax_cross_entropy(x, labels, ignore_index=-100, reduction=reduction)).backward()
    assert numpy.all(as_numpy(x.grad)[as_numpy(labels) == -100] == 0)


def test_cross_entropy_mean_of_all_ignored_is_zero_not_nan(xp):
    logits = Tensor(_randn(xp, 3, 4, seed=3), requires_grad=True)
    labels = xp.asarray([-1, -1, -1])
    y = F.softmax_cross_entropy(logits, labels, ignore_index=-1)
    assert float(y.item()) == 0.0
    y.backward()
    assert numpy.all(as_numpy(logits.grad) == 0)


def test_cross_entropy_float32_stays_float32_and_is_stable(xp):
    logits = xp.asarray(numpy.array([[1000.0, 0.0, -1000.0], [5.0, 5.0, 5.0]], numpy.float32))
    x = Tensor(logits, requires_grad=True)
    y = F.softmax_cross_entropy(x, xp.asarray([0, 1]))
    assert y.dtype == numpy.float32
    assert allclose(y.data, numpy.float32(numpy.log(3.0) / 2), scale=10)
    y.backward()
    assert x.grad.dtype == numpy.float32 and numpy.all(numpy.isfinite(as_numpy(x.grad)))


def test_cross_entropy_errors_name_the_problem():
    logits = Tensor(numpy.zeros((2, 3)))
    with pytest.raises(ValueError, match="out of range"):
        F.softmax_cross_entropy(logits, numpy.array([0, 3]))
    with pytest.raises(ValueError, match="do not match"):
        F.softmax_cross_entropy(logits, numpy.array([0, 1, 2]))
    with pytest.raises(ValueError, match="reduction"):
        F.softmax_cross_entropy(logits, numpy.array([0, 1]), reduction="avg")


def test_mean_squared_error(xp):
    a, b = _randn(xp, 3, 4, seed=4), _randn(xp, 3, 4, seed=5)
    y = F.mean_squared_error(Tensor(a), Tensor(b))
    assert allclose(y.data, ((as_numpy(a) - as_numpy(b)) ** 2).mean())
    assert gradcheck(F.mean_squared_error, [a, b])


def test_host_labels_are_checked_on_the_host_before_they_move_to_the_device():
    # On a GPU an out-of-range label is no error but a wrong loss (CuPy's take wraps
    # indices), so the check runs on the host labels before the transfer. A fake device
    # array stands in for CuPy: the error must come before any device work.
    from mpidl.testing.fakedevice import fake_cupy

    with fake_cupy() as cp:
        logits = Tensor(cp.asarray(numpy.zeros((3, 4))))
        with pytest.raises(ValueError, match="label 4 is out of range for 4 classes"):
            F.softmax_cross_entropy(logits, numpy.array([0, 4, 1]))
        with pytest.raises(ValueError, match="label -2 is out of range"):
            F.softmax_cross_entropy(logits, numpy.array([[-2], [0], [1]]).reshape(3),
                                    ignore_index=-100)
        assert cp.copies() == []  # nothing reached the device


def test_host_labels_equal_to_ignore_index_pass_the_check(xp):
    logits = Tensor(_randn(xp, 3, 4, seed=4))
    y = F.softmax_cross_entropy(logits, numpy.array([1, -100, 3]), ignore_index=-100)
    ref = _reference(as_numpy(logits.data), numpy.array([1, -100, 3]), ignore_index=-100)
    assert allclose(y.data, ref)
