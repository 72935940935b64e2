"""Scaled dot-product attention as one Function with a hand-written backward.

Shapes: ``q`` is ``(B, H, Tq, D)``, ``k`` is ``(B, H, Tk, D)``, ``v`` is
``(B, H, Tk, Dv)``; the output is ``(B, H, Tq, Dv)``. Forward keeps the attention
probabilities ``P`` (``(B, H, Tq, Tk)``) and the output (with ``keep_probs=False`` it
drops ``P`` and backward recomputes it: selective activation recomputation); backward is

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(dO * O)),
    dQ = dS K / sqrt(D),   dK = dS^T Q / sqrt(D)

where ``rowsum(dO * O)`` equals ``rowsum(dP * P)`` (the FlashAttention identity) but
costs ``Tq x Dv`` instead of ``Tq x Tk``. The scale is applied to the ``(T, D)`` side,
never to a ``(Tq, Tk)`` array.
"""
from __future__ import annotations

import math
from typing import Any

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, to_device
from mpidl.functions.half import widened
from mpidl.functions.math import sum_last_axis, sum_to


def causal_mask(xp: Any, tq: int, tk: int) -> Any:
    """Boolean ``(Tq, Tk)`` mask, True where query ``i`` may see key ``j``.

    Aligned at the bottom right: the last query sees every key, so with ``Tq < Tk``
    (new queries after a cached prefix) query ``i`` sees keys ``j <= i + Tk - Tq``.
    For ``Tq == Tk`` this is the usual lower triangle.
    """
    return xp.tri(tq, tk, k=tk - tq, dtype=bool)


# 16-bit floats: scores, softmax and its sums in float32, the output rounded once (as
# fused attention kernels accumulate in float32); q, k and v are kept widened.
@widened
class ScaledDotProductAttention(Function):
    keep_probs = True

    def forward(self, q, k, v, mask):
        xp = get_array_module(q)
        self.scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
        self.q, self.k, self.v, self.mask = q, k, v, mask
        p = self._probs(xp)
        o = xp.matmul(p, v)  # (B, H, Tq, Dv)
        # Selective recomputation (Korthikanti et al. 2022) drops P, the one (Tq, Tk)
        # array of the layer: backward recomputes it from q and k with the very same
        # operations, so it is the same P bit for bit (no dropout on P: no randomness).
        self.p = p if self.keep_probs else None
        self.o = o
        return o

    def _probs(self, xp):
        """The attention probabilities ``P`` ``(B, H, Tq, Tk)`` of the saved q, k, mask."""
        q, k, keep = self.q, self.k, self.mask
        if self.causal:
            c = causal_mask(xp, q.shape[-2], k.shape[-2])
            keep = c if keep is None else xp.logical_and(keep, c)
        qs = q * self.scale
        s = xp.matmul(qs, xp.swapaxes(k, -1, -2))  # (B, H, Tq, Tk)
        if keep is not None:
            # Masked scores get the lowest finite value (not -inf, which turns a row with
            # every key masked into NaN); after exp they are zeroed through `keep`.
            xp.copyto(s, xp.finfo(s.dtype).min, where=xp.logical_not(keep))
        s -= s.max(axis=-1, keepdims=True)
        p = xp.exp(s, out=s)
        # Masked entries are now exactly 0 in every row that keeps some key. A row that
        # keeps none holds exp(0) = 1 everywhere; it must attend to nothing (output 0,
        # gradient 0), so its normaliser becomes 0 instead of 1 / Tk.
        inv = sum_last_axis(p)  # (B, H, Tq, 1)
        xp.divide(1, inv, out=inv)
        if keep is not None:
            inv *= keep.any(axis=-1, keepdims=True)  # (.., Tq, 1): small
        p *= inv
        return p

    def backward(self, go):
        xp = get_array_module(go)
        nq, nk, nv, _ = self.needs_input_grad
        q, k, v, o = self.q, self.k, self.v, self.o
        p = self.p if self.p is not None else self._probs(xp)
        gq = gk = gv = None
        if nv:
            gv = xp.matmul(xp.swapaxes(p, -1, -2), go)  # (B, H, Tk, Dv)
        if nq or nk:
            gs = xp.matmul(go, xp.swapaxes(v, -1, -2))  # dP, (B, H, Tq, Tk)
            delta = xp.einsum("...i,...i->...", go, o)[..., None]  # (B, H, Tq, 1)
            gs -= delta
            gs *= p  # dS
            if nq:
                gq = xp.matmul(gs, k)
                gq *= self.scale
            if nk:
                gk = xp.matmul(xp.swapaxes(gs, -1, -2), q)
                gk *= self.scale
        gq = _unbroadcast(gq, q.shape)
        gk = _unbroadcast(gk, k.shape)
        gv = _unbroadcast(gv, v.shape)
        return gq, gk, gv, None


def _unbroadcast(g: Any, shape: tuple[int, ...]) -> Any:
    if g is None or g.shape == shape:
        return g
    return sum_to(g, shape)


def scaled_dot_product_attention(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None,
    keep_probs: bool = True,
) -> Tensor:
    """``softmax(q k^T / sqrt(D) + masking) v`` over ``(B, H, T, D)`` tensors.

    Args:
        q: queries ``(B, H, Tq, D)``.
        k: keys ``(B, H, Tk, D)``.
        v: values ``(B, H, Tk, Dv)``.
        causal: query ``i`` sees keys ``j <= i + Tk - Tq`` only (see :func:`causal_mask`).
        mask: boolean array broadcastable to ``(B, H, Tq, Tk)``, True where a key may be
            attended (for example ``(B, 1, 1, Tk)`` for padding). Combined with
            ``causal`` by logical and. A query with no key kept gets output 0.
        keep_probs: keep ``P`` ``(B, H, Tq, Tk)`` for backward (the default); False
            recomputes it in backward from q and k (selective recomputation: the
            ``Tq x Tk`` bytes go, one more ``q k^T`` and softmax is the price; the
            gradients are the same bit for bit).

    Returns:
        ``(B, H, Tq, Dv)``.
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(
                f"scaled_dot_product_attention: {name} has shape {tuple(a.shape)}; "
                "expected (batch, heads, time, head_dim)"
            )
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"scaled_dot_product_attention: q {tuple(q.shape)}, k {tuple(k.shape)} and "
            f"v {tuple(v.shape)} do not fit (q and k share head_dim, k and v share time)"
        )
    if isinstance(mask, Tensor):
        mask = mask.data
    if mask is not None:
        if mask.dtype != bool:
            raise TypeError(
                f"attention mask must be boolean (True = keep), got dtype {mask.dtype}"
            )
        # A host mask (a loader's padding mask) moves with q/k/v, as ids and labels do:
        # CuPy's logical_and/logical_not take no NumPy arrays.
        mask = to_device(mask, get_array_module(q))
    return ScaledDotProductAttention.apply(q, k, v, mask, causal=causal,
                                           keep_probs=keep_probs)
