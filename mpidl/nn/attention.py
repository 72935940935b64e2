"""Multi-head self-attention (Vaswani et al. 2017) over ``(B, T, D)`` sequences.

One ``(D, 3D)`` projection makes queries, keys and values together; the heads are split
from it by one Function with three outputs (instead of a reshape, a transpose and three
indexing nodes, each of whose backward would build a zero-filled ``(3, B, H, T, Dh)``
array); attention itself is :func:`mpidl.functions.scaled_dot_product_attention`, fused
forward and backward.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl import functions as F
from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module
from mpidl.nn import init
from mpidl.nn.linear import Linear
from mpidl.nn.module import Module, Parameter, default_dtype


class SplitHeads(Function):
    """``(B, T, 3*H*Dh)`` -> three ``(B, H, T, Dh)`` views: q, k, v."""

    def forward(self, qkv):
        b, t, width = qkv.shape
        # Head size spelled out, not -1: an empty batch (a rank with no samples in the
        # last step of an epoch) has size 0, and -1 cannot be inferred from it.
        dh = width // (3 * self.heads)
        x = qkv.reshape(b, t, 3, self.heads, dh).transpose(2, 0, 3, 1, 4)  # (3, B, H, T, Dh)
        # Views, not copies: each (T, Dh) matrix still has unit stride along Dh, so matmul
        # hands it to BLAS as is (measured: copying first is slower overall).
        return x[0], x[1], x[2]

    def backward(self, gq, gk, gv):
        xp = get_array_module(*(g for g in (gq, gk, gv) if g is not None))
        like = next(g for g in (gq, gk, gv) if g is not None)
        b, h, t, dh = like.shape
        g = xp.empty((b, t, 3, h, dh), dtype=like.dtype)
        for i, gi in enumerate((gq, gk, gv)):
            if gi is None:  # an output nobody used (e.g. only q was needed)
                g[:, :, i] = 0
            else:
                g[:, :, i] = gi.transpose(0, 2, 1, 3)
        return g.reshape(b, t, 3 * h * dh)


class MergeHeads(Function):
    """``(B, H, T, Dh)`` -> ``(B, T, H*Dh)``, heads side by side."""

    def forward(self, x):
        b, h, t, dh = x.shape
        return x.transpose(0, 2, 1, 3).reshape(b, t, h * dh)  # reshape copies once

    def backward(self, gy):
        b, t, d = gy.shape
        h = self.heads
        return gy.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)


def split_heads(qkv: Any, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """Split a fused ``(B, T, 3D)`` projection into q, k, v of shape ``(B, H, T, D/H)``."""
    if qkv.shape[-1] % (3 * heads):
        raise ValueError(
            f"split_heads: last axis {qkv.shape[-1]} is not divisible by 3 * heads = {3 * heads}"
        )
    return SplitHeads.apply(qkv, heads=heads)


def merge_heads(x: Any) -> Tensor:
    """``(B, H, T, Dh)`` -> ``(B, T, H*Dh)``."""
    return MergeHeads.apply(x, heads=x.shape[1])


class MultiHeadAttention(Module):
    """Multi-head self-attention: ``out_proj(attention(split(in_proj(x))))``.

    Parameters (PyTorch's ``nn.MultiheadAttention`` under other names):
    ``in_proj.weight`` ``(3D, D)`` (rows: q, k, v) Xavier-uniform, ``in_proj.bias`` zeros,
    ``out_proj.weight`` ``(D, D)`` Kaiming-uniform, ``out_proj.bias`` zeros.

    Args:
        dim: model width D; must be divisible by ``heads``.
        heads: number of heads H.
        causal: position t attends to positions <= t only (language models).
        seed, rng: where the initial values come from (see :mod:`mpidl.nn.init`).
        dtype: parameter dtype (float32 by default).
    """

    def __init__(self, dim: int, heads: int, causal: bool = False, *,
                 seed: int | None = None, rng: numpy.random.Generator | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if heads <= 0 or dim % heads:
            raise ValueError(f"MultiHeadAttention: dim={dim} must be divisible by heads={heads}")
        rng = init.make_rng(seed, rng)
        dtype = default_dtype(dtype)
        self.dim, self.heads, self.causal = dim, heads, causal
        self.in_proj = Linear(dim, 3 * dim, rng=rng, dtype=dtype)
        self.in_proj.weight = Parameter(init.xavier_uniform((3 * dim, dim), rng, dtype))
        self.in_proj.bias = Parameter(init.zeros((3 * dim,), dtype))
        self.out_proj = Linear(dim, dim, rng=rng, dtype=dtype)
        self.out_proj.bias = Parameter(init.zeros((dim,), dtype))

    def forward(self, x: Any, mask: Any = None, keep_probs: bool = True) -> Tensor:
        """Attend over ``x`` ``(B, T, D)``; ``mask`` and ``keep_probs`` (False: selective
        recomputation) go to :func:`mpidl.functions.scaled_dot_product_attention`."""
        q, k, v = split_heads(self.in_proj(x), self.heads)  # 3 x (B, H, T, Dh)
        y = F.scaled_dot_product_attention(q, k, v, causal=self.causal, mask=mask,
                                           keep_probs=keep_probs)
        return self.out_proj(merge_heads(y))  # (B, T, D)

    def extra_repr(self) -> str:
        return f"{self.dim}, heads={self.heads}, causal={self.causal}"
