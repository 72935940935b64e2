"""Pooling layers over 1, 2 and 3 spatial axes (:mod:`mpidl.functions.pool`)."""
from __future__ import annotations

from typing import Any

from mpidl.autograd import Tensor
from mpidl.functions import pool
from mpidl.nn.module import Module


def _check_rank(layer: Module, x: Any, d: int) -> None:
    if x.ndim != d + 2:
        raise ValueError(f"{type(layer).__name__}: input of shape {tuple(x.shape)} must have "
                         f"{d + 2} dimensions (B, C and {d} spatial axes)")


class _MaxPoolNd(Module):
    """Max pooling: the largest value of each window (no parameters).

    Args:
        kernel_size: window size, an int or one per axis.
        stride: step between windows (default: ``kernel_size``).
        padding: implicit ``-inf`` padding on both sides (at most half the window).
        dilation: spacing of the window's elements.
    """

    dims = 0

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0,
                 dilation: Any = 1) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride
        self.padding, self.dilation = padding, dilation

    def forward(self, x: Any) -> Tensor:
        _check_rank(self, x, self.dims)
        return pool.max_pool(x, self.kernel_size, self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        return (f"kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}")


class _AvgPoolNd(Module):
    """Average pooling: the mean of each window (no parameters).

    Args:
        kernel_size, stride: as max pooling's.
        padding: implicit zero padding on both sides (at most half the window).
        count_include_pad: divide by the window size (True, PyTorch's default) or by the
            number of its elements inside the input.
    """

    dims = 0

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0,
                 count_include_pad: bool = True) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride
        self.padding, self.count_include_pad = padding, count_include_pad

    def forward(self, x: Any) -> Tensor:
        _check_rank(self, x, self.dims)
        return pool.avg_pool(x, self.kernel_size, self.stride, self.padding,
                             self.count_include_pad)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class _AdaptiveAvgPoolNd(Module):
    """Average pooling to a fixed output size, whatever the input's.

    Args:
        output_size: an int or one per axis (None keeps that axis); 1 is global average
            pooling.
    """

    dims = 0

    def __init__(self, output_size: Any) -> None:
        super().__init__()
        self.output_size = output_size

    def forward(self, x: Any) -> Tensor:
        _check_rank(self, x, self.dims)
        return pool.adaptive_avg_pool(x, self.output_size)

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class MaxPool1d(_MaxPoolNd):
    """Max pooling of ``(B, C, L)``."""

    dims = 1


class MaxPool2d(_MaxPoolNd):
    """Max pooling of ``(B, C, H, W)``."""

    dims = 2


class MaxPool3d(_MaxPoolNd):
    """Max pooling of ``(B, C, D, H, W)``."""

    dims = 3


class AvgPool1d(_AvgPoolNd):
    """Average pooling of ``(B, C, L)``."""

    dims = 1


class AvgPool2d(_AvgPoolNd):
    """Average pooling of ``(B, C, H, W)``."""

    dims = 2


class AvgPool3d(_AvgPoolNd):
    """Average pooling of ``(B, C, D, H, W)``."""

    dims = 3


class AdaptiveAvgPool1d(_AdaptiveAvgPoolNd):
    """Adaptive average pooling of ``(B, C, L)``."""

    dims = 1


class AdaptiveAvgPool2d(_AdaptiveAvgPoolNd):
    """Adaptive average pooling of ``(B, C, H, W)``."""

    dims = 2


class AdaptiveAvgPool3d(_AdaptiveAvgPoolNd):
    """Adaptive average pooling of ``(B, C, D, H, W)``."""

    dims = 3
