"""scaled_dot_product_attention: forward against a direct NumPy softmax(QK^T/sqrt d)V,
hand-written backward against finite differences; causal, boolean masks, both."""
from __future__ import annotations

import math

import numpy
import pytest

import mpidl.functions as F
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy
from mpidl.testing import allclose
from mpidl.testing.gradcheck import gradcheck


def _randn(xp, *shape, seed=0, dtype=numpy.float64):
    return xp.asarray(numpy.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _reference(q, k, v, keep=None):
    s = q @ numpy.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = numpy.where(keep, s, -numpy.inf)
    with numpy.errstate(invalid="ignore"):
        p = numpy.exp(s - s.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
    p = numpy.nan_to_num(p)  # rows with no key kept: zeros
    return p @ v


def _qkv(xp, b=2, h=3, tq=4, tk=4, d=5, dv=3, seed=0):
    return (_randn(xp, b, h, tq, d, seed=seed), _randn(xp, b, h, tk, d, seed=seed + 1),
            _randn(xp, b, h, tk, dv, seed=seed + 2))


def test_attention_without_mask(xp):
    q, k, v = _qkv(xp, tq=3, tk=6)
    y = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v))
    assert y.shape == (2, 3, 3, 3)
    assert allclose(y.data, _reference(*map(as_numpy, (q, k, v))))
    assert gradcheck(F.scaled_dot_product_attention, [q, k, v])


def test_attention_causal(xp):
    q, k, v = _qkv(xp, tq=5, tk=5, seed=3)
    keep = numpy.tril(numpy.ones((5, 5), bool))
    y = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), causal=True)
    assert allclose(y.data, _reference(*map(as_numpy, (q, k, v)), keep))
    assert gradcheck(lambda *t: F.scaled_dot_product_attention(*t, causal=True), [q, k, v])


def test_attention_causal_with_fewer_queries_aligns_bottom_right(xp):
    q, k, v = _qkv(xp, tq=2, tk=5, seed=6)
    keep = numpy.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    y = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), causal=True)
    assert allclose(y.data, _reference(*map(as_numpy, (q, k, v)), keep))
    assert gradcheck(lambda *t: F.scaled_dot_product_attention(*t, causal=True), [q, k, v])


def test_attention_with_padding_mask(xp):
    q, k, v = _qkv(xp, tq=4, tk=6, seed=9)
    lengths = numpy.array([6, 2])
    keep = (numpy.arange(6)[None, :] < lengths[:, None])[:, None, None, :]  # (B, 1, 1, Tk)
    mask = xp.asarray(keep)
    y = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), mask=mask)
    assert allclose(y.data, _reference(*map(as_numpy, (q, k, v)), keep))
    assert gradcheck(lambda *t: F.scaled_dot_product_attention(*t, mask=mask), [q, k, v])


def test_attention_with_mask_and_causal_and_an_empty_row(xp):
    q, k, v = _qkv(xp, b=1, h=2, tq=4, tk=4, seed=12)
    keep = numpy.array([[0, 1, 1, 1], [1, 1, 0, 1], [1, 0, 1, 1], [1, 1, 1, 0]], bool)
    both = keep & numpy.tril(numpy.ones((4, 4), bool))  # row 0 sees nothing
    mask = xp.asarray(keep)
    y = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), causal=True, mask=mask)
    out = as_numpy(y.data)
    assert numpy.all(numpy.isfinite(out)) and numpy.all(out[..., 0, :] == 0)
    assert allclose(out, _reference(*map(as_numpy, (q, k, v)), both))
    assert gradcheck(lambda *t: F.scaled_dot_product_attention(*t, causal=True, mask=mask),
                     [q, k, v])


def test_attention_float32_matches_float64(xp):
    q, k, v = (a.astype(numpy.float32) for a in _qkv(xp, b=2, h=2, tq=16, tk=16, d=8, dv=8))
    ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    y = F.scaled_dot_product_attention(*ts, causal=True)
    assert y.dtype == numpy.float32
    F.sum(y * y).backward()
    ts64 = [Tensor(a.astype(numpy.float64), requires_grad=True) for a in (q, k, v)]
    y64 = F.scaled_dot_product_attention(*ts64, causal=True)
    F.sum(y64 * y64).backward()
    assert allclose(y.data, as_numpy(y64.data).astype(numpy.float32), scale=10)
    for t, t64 in zip(ts, ts64):
        assert t.grad.dtype == numpy.float32
        assert allclose(t.grad, as_numpy(t64.grad).astype(numpy.float32), scale=20)


def test_attention_checks_shapes_and_mask_dtype():
    q = Tensor(numpy.zeros((1, 1, 2, 4)))
    with pytest.raises(ValueError, match="batch, heads, time, head_dim"):
        F.scaled_dot_product_attention(Tensor(numpy.zeros((2, 4))), q, q)
    with pytest.raises(ValueError, match="do not fit"):
        F.scaled_dot_product_attention(q, Tensor(numpy.zeros((1, 1, 2, 3))), q)
    with pytest.raises(TypeError, match="boolean"):
        F.scaled_dot_product_attention(q, q, q, mask=numpy.ones((2, 2)))


def test_a_host_mask_is_moved_to_the_device_of_q_k_v(monkeypatch):
    # CuPy's logical_and takes no NumPy arrays; ids and labels move, so must the mask.
    # A fake device array stands in for CuPy; the Function sees what it would compute on.
    from mpidl.functions import attention
    from mpidl.testing.fakedevice import FakeDeviceArray, fake_cupy

    seen = {}
    monkeypatch.setattr(attention.ScaledDotProductAttention, "apply",
                        classmethod(lambda cls, q, k, v, mask, **params: seen.update(mask=mask)))
    with fake_cupy() as cp:
        q, k, v = (cp.asarray(a) for a in _qkv(numpy))
        keep = numpy.ones((2, 1, 1, 4), dtype=bool)
        F.scaled_dot_product_attention(q, k, v, mask=keep)
    assert isinstance(seen["mask"], FakeDeviceArray)
    numpy.testing.assert_array_equal(seen["mask"].get(), keep)


def test_a_host_mask_gives_the_same_attention_on_every_backend(xp):
    q, k, v = _qkv(xp, seed=7)
    keep = numpy.array([True, True, False, True])[None, None, None, :]  # on the host
    y = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), mask=keep)
    ref = _reference(*(as_numpy(a) for a in (q, k, v)), keep=keep)
    assert allclose(y.data, ref)


@pytest.mark.parametrize("causal", [False, True])
def test_recomputing_the_probabilities_gives_the_kept_ones_gradients_bit_for_bit(xp, causal):
    # Selective recomputation (keep_probs=False): no (Tq, Tk) array is kept, and the one
    # backward rebuilds is the forward's, so q, k and v get the same gradients exactly;
    # the mask hides every key of one row (output and gradient 0 there).
    q, k, v = _qkv(xp, tq=3, tk=5, seed=3)
    keep = numpy.ones((2, 1, 3, 5), dtype=bool)
    keep[1, 0, 2] = False
    grads, outputs = {}, {}
    for keep_probs in (True, False):
        ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
        y = F.scaled_dot_product_attention(*ts, causal=causal, mask=keep,
                                           keep_probs=keep_probs)
        assert (y.creator.p is None) is (not keep_probs)
        F.sum(y * y).backward()
        outputs[keep_probs], grads[keep_probs] = y.data, [t.grad for t in ts]
    assert (outputs[True] == outputs[False]).all()
    assert all((a == b).all() for a, b in zip(grads[True], grads[False]))
