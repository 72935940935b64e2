"""Pooling over 1, 2 or 3 spatial axes: max, average, and adaptive (global) average.

Layout ``x (B, C, *S)`` -> ``y (B, C, *P)``, PyTorch's semantics (``ceil_mode=False``).

Max and average pooling loop over the ``prod(K)`` kernel offsets, each a strided view
of the padded input with the output's shape, instead of unfolding the input: one
elementwise pass per offset and no ``prod(K)``-times-larger array. Backward adds into
the same views (within one offset the output positions hit distinct inputs, so a
plain ``+=`` is exact even for overlapping windows).

Max pooling keeps, per output, the index of the offset that won (int8 for up to 127
offsets): the first maximum in window order, as PyTorch, which matters after a ReLU
where whole windows tie at 0 (the gradient goes to one element, not to all of them). A
NaN wins its window, as in PyTorch, so a non-finite activation is not hidden.

Adaptive average pooling averages, per axis, over the windows
``[floor(i S / P), ceil((i + 1) S / P))``; a box average is the product of per-axis
averages, so it is one small averaging matrix ``(P, S)`` applied per axis (exact for
any sizes); the global case (``P = 1``) is one matrix-vector product.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module
from mpidl.functions.conv import ntuple, output_size, pad_input, unpad, window_slices


def _offsets(kernel: tuple[int, ...]) -> Any:
    return itertools.product(*(range(k) for k in kernel))


def _view(xpad: Any, offset: tuple, dilation: tuple, stride: tuple, out: tuple) -> Any:
    return xpad[(slice(None), slice(None)) + window_slices(offset, dilation, stride, out)]


class MaxPool(Function):
    owned_grads = (0,)

    def forward(self, x):
        xp = get_array_module(x)
        self.x_shape = x.shape
        xpad = pad_input(x, self.pads, value=-numpy.inf)
        out = self.out
        k = math.prod(self.kernel)
        index_dtype = numpy.int8 if k <= 127 else numpy.int16 if k <= 32767 else numpy.int32
        y = idx = None
        for n, offset in enumerate(_offsets(self.kernel)):
            v = _view(xpad, offset, self.dilation, self.stride, out)
            if y is None:
                y = xp.array(v, copy=True)
                idx = xp.zeros(y.shape, dtype=index_dtype)
                continue
            take = v > y
            take |= xp.isnan(v)
            xp.copyto(y, v, where=take)
            xp.copyto(idx, index_dtype(n), where=take)
        self.idx = idx
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        spatial = tuple(s + a + b for s, (a, b) in zip(self.x_shape[2:], self.pads))
        gxpad = xp.zeros(self.x_shape[:2] + spatial, dtype=gy.dtype)
        for n, offset in enumerate(_offsets(self.kernel)):
            view = _view(gxpad, offset, self.dilation, self.stride, self.out)
            view += xp.where(self.idx == n, gy, 0)
        return unpad(gxpad, self.pads)


class AvgPool(Function):
    owned_grads = (0,)

    def forward(self, x):
        xp = get_array_module(x)
        self.x_shape = x.shape
        xpad = pad_input(x, self.pads)
        ones = (1,) * len(self.kernel)
        y = None
        for offset in _offsets(self.kernel):
            v = _view(xpad, offset, ones, self.stride, self.out)
            if y is None:
                y = xp.array(v, copy=True)
            else:
                y += v
        self.divisor = self._divisor(xp, x.dtype)
        y *= self.divisor
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        g = gy * self.divisor
        spatial = tuple(s + a + b for s, (a, b) in zip(self.x_shape[2:], self.pads))
        gxpad = xp.zeros(self.x_shape[:2] + spatial, dtype=gy.dtype)
        ones = (1,) * len(self.kernel)
        for offset in _offsets(self.kernel):
            _view(gxpad, offset, ones, self.stride, self.out)[...] += g
        return unpad(gxpad, self.pads)

    def _divisor(self, xp: Any, dtype: Any) -> Any:
        """``1 / count`` per output position: the window size, or (without
        ``count_include_pad``) the number of its elements inside the input."""
        k = math.prod(self.kernel)
        if self.count_include_pad or not any(a or b for a, b in self.pads):
            return dtype.type(1.0 / k)
        # Count the real elements of each window: pool a (1, 1, *S) array of ones.
        spatial = self.x_shape[2:]
        ones = pad_input(numpy.ones((1, 1) + spatial), self.pads)
        counts = numpy.zeros((1, 1) + self.out)
        for offset in _offsets(self.kernel):
            counts += _view(ones, offset, (1,) * len(spatial), self.stride, self.out)
        return xp.asarray((1.0 / counts).astype(dtype))


def adaptive_windows(size: int, out: int) -> list[tuple[int, int]]:
    """PyTorch's adaptive pooling windows of one axis: ``[floor(i S/P), ceil((i+1) S/P))``."""
    return [((i * size) // out, -((-(i + 1) * size) // out)) for i in range(out)]


def _averaging_matrix(size: int, out: int, dtype: Any) -> numpy.ndarray:
    """``A (P, S)`` with ``A[i, window i] = 1 / len(window i)``: ``y = A @ x`` per axis."""
    a = numpy.zeros((out, size))
    for i, (lo, hi) in enumerate(adaptive_windows(size, out)):
        a[i, lo:hi] = 1.0 / (hi - lo)
    return a.astype(dtype)


class AdaptiveAvgPool(Function):
    owned_grads = (0,)

    def forward(self, x):
        xp = get_array_module(x)
        self.x_shape = x.shape
        b, c = x.shape[:2]
        spatial = x.shape[2:]
        if all(p == 1 for p in self.out):
            # Global average: one matrix-vector product over the flattened positions.
            n = math.prod(spatial)
            x3 = x.reshape(b, c, n)
            y = xp.matmul(x3, xp.full(n, 1.0 / n, dtype=x.dtype))
            return y.reshape((b, c) + self.out)
        self.mats = [xp.asarray(_averaging_matrix(s, p, x.dtype))
                     for s, p in zip(spatial, self.out)]
        return self._apply(x, self.mats, transpose=False)

    def backward(self, gy):
        xp = get_array_module(gy)
        b, c = self.x_shape[:2]
        spatial = self.x_shape[2:]
        if all(p == 1 for p in self.out):
            n = math.prod(spatial)
            gx = xp.empty((b, c, n), dtype=gy.dtype)
            gx[...] = gy.reshape(b, c, 1) * gy.dtype.type(1.0 / n)
            return gx.reshape(self.x_shape)
        return xp.ascontiguousarray(self._apply(gy, self.mats, transpose=True))

    @staticmethod
    def _apply(x: Any, mats: list, transpose: bool) -> Any:
        """Contract every spatial axis ``j`` with ``mats[j]`` (or its transpose)."""
        xp = get_array_module(x)
        y = x
        for j, a in enumerate(mats):
            axis = 2 + j
            m = a if transpose else a.T  # y_axis (.., S) @ A.T (S, P) -> (.., P)
            y = xp.moveaxis(xp.matmul(xp.moveaxis(y, axis, -1), m), -1, axis)
        return xp.ascontiguousarray(y)


# -- the functional API ----------------------------------------------------------------
def _pool_args(x: Any, d: int, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
               name: str) -> dict:
    if x.ndim != d + 2:
        raise ValueError(f"{name}: input of shape {tuple(x.shape)} must be (B, C) + {d} "
                         f"spatial axes ({d + 2} dimensions)")
    kernel = ntuple(kernel_size, d, "kernel_size")
    stride = kernel if stride is None else ntuple(stride, d, "stride")
    dilation = ntuple(dilation, d, "dilation")
    pad = ntuple(padding, d, "padding")
    if min(kernel) < 1 or min(stride) < 1 or min(dilation) < 1:
        raise ValueError(f"{name}: kernel_size={kernel}, stride={stride} and "
                         f"dilation={dilation} must be >= 1")
    if any(2 * p > k for p, k in zip(pad, kernel)):
        raise ValueError(f"{name}: padding={pad} must be at most half of kernel_size={kernel} "
                         "(PyTorch's rule: a window never lies only in the padding)")
    pads = tuple((p, p) for p in pad)
    out = tuple(output_size(s, k, st, p, dl) for s, k, st, p, dl in
                zip(x.shape[2:], kernel, stride, pads, dilation))
    if min(out) < 1:
        raise ValueError(f"{name}: input spatial size {tuple(x.shape[2:])} is smaller than "
                         f"the window {kernel} (dilation {dilation}, padding {pad}): the "
                         f"output would be {out}")
    return dict(kernel=kernel, stride=stride, dilation=dilation, pads=pads, out=out)


def max_pool(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
             dilation: Any = 1) -> Tensor:
    """Max pooling over the ``x.ndim - 2`` spatial axes of ``x (B, C, *S)``.

    Args:
        kernel_size: window size, an int or one per axis.
        stride: step between windows (default: ``kernel_size``).
        padding: implicit ``-inf`` padding on both sides (at most half the window).
        dilation: spacing of the window's elements.
    """
    d = x.ndim - 2
    return MaxPool.apply(x, **_pool_args(x, d, kernel_size, stride, padding, dilation,
                                         f"max_pool{d}d"))


def avg_pool(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
             count_include_pad: bool = True) -> Tensor:
    """Average pooling over the spatial axes of ``x (B, C, *S)``.

    Args:
        kernel_size, stride, padding: as :func:`max_pool` (zero padding).
        count_include_pad: divide by the window size (True, PyTorch's default) or by the
            number of its elements inside the input.
    """
    d = x.ndim - 2
    args = _pool_args(x, d, kernel_size, stride, padding, 1, f"avg_pool{d}d")
    del args["dilation"]
    return AvgPool.apply(x, count_include_pad=bool(count_include_pad), **args)


def adaptive_avg_pool(x: Any, output_size: Any) -> Tensor:
    """Average pooling to a fixed output size ``P`` whatever the input size.

    ``output_size`` is an int or one per axis; ``None`` in a position keeps that axis'
    size; 1 everywhere is global average pooling.
    """
    d = x.ndim - 2
    if d < 1:
        raise ValueError(f"adaptive_avg_pool: input of shape {tuple(x.shape)} has no spatial "
                         "axes; expected (B, C, *S)")
    sizes = (output_size,) * d if isinstance(output_size, int) or output_size is None \
        else tuple(output_size)
    if len(sizes) != d:
        raise ValueError(f"adaptive_avg_pool{d}d: output_size={output_size} has {len(sizes)} "
                         f"entries for {d} spatial axes")
    out = tuple(s if p is None else int(p) for s, p in zip(x.shape[2:], sizes))
    if min(out) < 1:
        raise ValueError(f"adaptive_avg_pool{d}d: output_size={out} must be >= 1")
    return AdaptiveAvgPool.apply(x, out=out)


def _check_rank(x: Any, d: int, name: str) -> None:
    if x.ndim != d + 2:
        raise ValueError(f"{name}: input of shape {tuple(x.shape)} must have {d + 2} "
                         f"dimensions (B, C and {d} spatial axes)")


def max_pool1d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               dilation: Any = 1) -> Tensor:
    """:func:`max_pool` of ``x (B, C, L)``."""
    _check_rank(x, 1, "max_pool1d")
    return max_pool(x, kernel_size, stride, padding, dilation)


def max_pool2d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               dilation: Any = 1) -> Tensor:
    """:func:`max_pool` of ``x (B, C, H, W)``."""
    _check_rank(x, 2, "max_pool2d")
    return max_pool(x, kernel_size, stride, padding, dilation)


def max_pool3d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               dilation: Any = 1) -> Tensor:
    """:func:`max_pool` of ``x (B, C, D, H, W)``."""
    _check_rank(x, 3, "max_pool3d")
    return max_pool(x, kernel_size, stride, padding, dilation)


def avg_pool1d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               count_include_pad: bool = True) -> Tensor:
    """:func:`avg_pool` of ``x (B, C, L)``."""
    _check_rank(x, 1, "avg_pool1d")
    return avg_pool(x, kernel_size, stride, padding, count_include_pad)


def avg_pool2d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               count_include_pad: bool = True) -> Tensor:
    """:func:`avg_pool` of ``x (B, C, H, W)``."""
    _check_rank(x, 2, "avg_pool2d")
    return avg_pool(x, kernel_size, stride, padding, count_include_pad)


def avg_pool3d(x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
               count_include_pad: bool = True) -> Tensor:
    """:func:`avg_pool` of ``x (B, C, D, H, W)``."""
    _check_rank(x, 3, "avg_pool3d")
    return avg_pool(x, kernel_size, stride, padding, count_include_pad)


def adaptive_avg_pool1d(x: Any, output_size: Any) -> Tensor:
    """:func:`adaptive_avg_pool` of ``x (B, C, L)``."""
    _check_rank(x, 1, "adaptive_avg_pool1d")
    return adaptive_avg_pool(x, output_size)


def adaptive_avg_pool2d(x: Any, output_size: Any) -> Tensor:
    """:func:`adaptive_avg_pool` of ``x (B, C, H, W)``."""
    _check_rank(x, 2, "adaptive_avg_pool2d")
    return adaptive_avg_pool(x, output_size)


def adaptive_avg_pool3d(x: Any, output_size: Any) -> Tensor:
    """:func:`adaptive_avg_pool` of ``x (B, C, D, H, W)``."""
    _check_rank(x, 3, "adaptive_avg_pool3d")
    return adaptive_avg_pool(x, output_size)
