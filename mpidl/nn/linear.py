"""Fully connected layer: ``y = x W^T + b``, forward and backward fused in one Function.

A Linear is the hottest op of the reference models. Composed from ``matmul``, a
transpose and a broadcast ``add`` it would be three graph nodes, a transposed weight
copy in backward and a reduction over a broadcast; fused it is one node whose forward is
one GEMM plus an in-place bias add and whose backward is two GEMMs and one column sum.
"""
from __future__ import annotations

import math
from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import compute_dtype, matmul
from mpidl.nn import init
from mpidl.nn.module import Module, Parameter, default_dtype


class LinearFunction(Function):
    """``x (..., in) @ weight.T (in, out) + bias (out,)`` -> ``(..., out)``."""

    owned_grads = (0, 1, 2)  # GEMM and column-sum results: fresh arrays

    def forward(self, x, weight, bias):
        n_in = weight.shape[1]
        x2 = x.reshape(-1, n_in)  # (N, in): a view for contiguous x
        # weight.T is a transposed view; matmul hands it to BLAS with a transpose flag.
        # 16-bit floats are multiplied in float32 and rounded once (backend.matmul).
        y = matmul(x2, weight.T)  # (N, out)
        if bias is not None:
            y += bias
        self.x2, self.weight, self.x_shape = x2, weight, x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    def backward(self, gy):
        nx, nw, nb = self.needs_input_grad
        gy2 = gy.reshape(-1, self.weight.shape[0])  # (N, out)
        gx = gw = gb = None
        if nx:
            gx = matmul(gy2, self.weight).reshape(self.x_shape)  # (N, in)
        # Weight and bias gradients go straight into their data-parallel bucket slices
        # when there are any (out=None: a fresh array).
        if nw:
            # (out, in), the weight's own layout
            gw = matmul(gy2.T, self.x2, out=self.grad_buffer_for(1))
        if nb:
            # Summed in float32 for 16-bit gy (a bfloat16 sum stops growing at 256).
            out = self.grad_buffer_for(2)
            gb = gy2.sum(axis=0, out=out, dtype=compute_dtype(gy2.dtype))
            if out is None and gb.dtype != gy2.dtype:
                gb = gb.astype(gy2.dtype)
        return gx, gw, gb


def linear(x: Any, weight: Any, bias: Any = None) -> Tensor:
    """``x @ weight.T + bias`` over the last axis of ``x``.

    Args:
        x: ``(..., in)`` input.
        weight: ``(out, in)``, PyTorch's layout (so state dicts translate one to one).
        bias: ``(out,)`` or None.
    """
    n_in = weight.shape[1]
    if x.shape[-1] != n_in:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features (shape {tuple(x.shape)}) but the "
            f"weight {tuple(weight.shape)} expects {n_in}"
        )
    return LinearFunction.apply(x, weight, bias)


class Linear(Module):
    """A fully connected layer ``y = x W^T + b``.

    Weights start as PyTorch's do: Kaiming-uniform, i.e. U(-1/sqrt(in), 1/sqrt(in)), and
    the bias U(-1/sqrt(in), 1/sqrt(in)).

    Args:
        in_features: size of the input's last axis.
        out_features: size of the output's last axis.
        bias: learn an additive bias.
        seed, rng: where the initial values come from (see :mod:`mpidl.nn.init`).
        dtype: parameter dtype (float32 by default; float64 for gradient checks).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 seed: int | None = None, rng: numpy.random.Generator | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"Linear needs positive sizes, got in_features={in_features}, "
                f"out_features={out_features}"
            )
        rng = init.make_rng(seed, rng)
        dtype = default_dtype(dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(init.kaiming_uniform((out_features, in_features), rng, dtype))
        if bias:
            self.bias = Parameter(init.uniform((out_features,), 1 / math.sqrt(in_features),
                                               rng, dtype))
        else:
            self.bias = None

    def forward(self, x: Any) -> Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"
