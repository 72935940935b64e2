"""Convolution layers over 1, 2 and 3 spatial axes (:mod:`mpidl.functions.conv`)."""
from __future__ import annotations

import math
from typing import Any

import numpy

from mpidl.autograd import Tensor
from mpidl.functions.conv import conv_padding, convolution, ntuple
from mpidl.nn import init
from mpidl.nn.module import Module, Parameter, default_dtype


class _ConvNd(Module):
    """A convolution with ``weight (out, in // groups, *kernel)`` and ``bias (out,)``.

    Weights start as PyTorch's do: Kaiming-uniform with ``a = sqrt(5)``, i.e.
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with ``fan_in = in // groups * prod(kernel)``,
    and the bias from the same range.

    Args:
        in_channels, out_channels: channel counts (both divisible by ``groups``).
        kernel_size: an int or one per spatial axis.
        stride, dilation: an int or one per axis.
        padding: zero padding: an int or one per axis, ``"valid"`` or ``"same"``.
        groups: independent channel groups (``groups == in_channels``: depthwise).
        bias: learn an additive bias per output channel.
        seed, rng: where the initial values come from (see :mod:`mpidl.nn.init`).
        dtype: parameter dtype (float32 by default; float64 for gradient checks).
    """

    dims = 0

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True, *,
                 seed: int | None = None, rng: numpy.random.Generator | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        d = self.dims
        name = type(self).__name__
        if in_channels <= 0 or out_channels <= 0:
            raise ValueError(f"{name} needs positive channel counts, got in_channels="
                             f"{in_channels}, out_channels={out_channels}")
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise ValueError(f"{name}: groups={groups} must divide in_channels={in_channels} "
                             f"and out_channels={out_channels}")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = ntuple(kernel_size, d, "kernel_size")
        self.stride = ntuple(stride, d, "stride")
        self.dilation = ntuple(dilation, d, "dilation")
        if min(self.kernel_size) < 1 or min(self.stride) < 1 or min(self.dilation) < 1:
            raise ValueError(f"{name}: kernel_size={self.kernel_size}, stride={self.stride} "
                             f"and dilation={self.dilation} must be >= 1")
        conv_padding(padding, self.kernel_size, self.dilation, self.stride)  # checks it
        self.padding = padding if isinstance(padding, str) else ntuple(padding, d, "padding")
        rng = init.make_rng(seed, rng)
        dtype = default_dtype(dtype)
        shape = (out_channels, in_channels // groups) + self.kernel_size
        self.weight = Parameter(init.kaiming_uniform(shape, rng, dtype))
        if bias:
            fan_in = (in_channels // groups) * math.prod(self.kernel_size)
            self.bias = Parameter(init.uniform((out_channels,), 1 / math.sqrt(fan_in), rng,
                                               dtype))
        else:
            self.bias = None

    def forward(self, x: Any) -> Tensor:
        return convolution(x, self.weight, self.bias, self.stride, self.padding,
                           self.dilation, self.groups)

    def extra_repr(self) -> str:
        parts = [f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"]
        ones, zeros = (1,) * self.dims, (0,) * self.dims
        if self.stride != ones:
            parts.append(f"stride={self.stride}")
        if self.padding != zeros:
            parts.append(f"padding={self.padding!r}")
        if self.dilation != ones:
            parts.append(f"dilation={self.dilation}")
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        if self.bias is None:
            parts.append("bias=False")
        return ", ".join(parts)


class Conv1d(_ConvNd):
    """1-D convolution of ``(B, C, L)`` (see :class:`_ConvNd` for the arguments)."""

    dims = 1


class Conv2d(_ConvNd):
    """2-D convolution of ``(B, C, H, W)`` (see :class:`_ConvNd` for the arguments)."""

    dims = 2


class Conv3d(_ConvNd):
    """3-D convolution of ``(B, C, D, H, W)`` (see :class:`_ConvNd` for the arguments)."""

    dims = 3
