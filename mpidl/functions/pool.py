"""Pooling over 1, 2 or 3 spatial axes: max, average, and adaptive (global) average.

Layout ``x (B, C, *S)`` -> ``y (B, C, *P)``, PyTorch's semantics (``ceil_mode=False``).

Max and average pooling are separable: the maximum (mean) over a box window is the
maximum (mean) along the last axis, then along the one before, and so on. So each is
one 1-D pass per spatial axis, over ``k`` strided views of that axis (``sum(K)`` array
operations instead of ``prod(K)``), and no unfolded copy of the input. Measured on
(64, 32, 28, 28) float32, 2x2 (one thread): 1.7 ms forward with the separable passes,
7 ms with one pass per kernel offset (``copyto(where=)`` and ``isnan`` per offset), 14
ms for the offset loop inside the layer; PyTorch 8.8 ms. For a stride-2 view of the last
axis NumPy merges every axis into one strided loop, which is why that axis goes first.

Max pooling keeps, per pass, which of the ``k`` views won (a bool for ``k = 2``, else
int8): the first maximum in window order, as PyTorch (reducing the last axis first
makes the separable first maximum the row-major first one), which matters after a
ReLU, where whole windows tie at 0: the gradient goes to one element, not to all of
them. A NaN propagates to the output, as in PyTorch (its gradient then follows the
first maximum of the pass, a case where the loss is NaN anyway). Backward routes the
gradient through the passes in reverse; where the views tile the input exactly (stride
= kernel, the common case) it writes each view once instead of adding into zeros.

Adaptive average pooling averages, per axis, over the windows
``[floor(i S / P), ceil((i + 1) S / P))``; a box average is the product of per-axis
averages, so it is one small averaging matrix ``(P, S)`` applied per axis (exact for
any sizes); the global case (``P = 1``) is one matrix-vector product.
"""
from __future__ import annotations

import math
from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module
from mpidl.functions.conv import ntuple, output_size


def _take(a: Any, axis: int, start: int, stop: int | None, step: int = 1) -> Any:
    """The view ``a[..., start:stop:step, ...]`` along ``axis``."""
    index = [slice(None)] * a.ndim
    index[axis] = slice(start, stop, step)
    return a[tuple(index)]


def _pad_axis(x: Any, axis: int, pad: tuple[int, int], value: float) -> Any:
    """``x`` padded along one axis with ``value`` (``x`` itself without padding)."""
    if not (pad[0] or pad[1]):
        return x
    xp = get_array_module(x)
    shape = list(x.shape)
    shape[axis] += pad[0] + pad[1]
    out = xp.full(shape, value, dtype=x.dtype)
    _take(out, axis, pad[0], pad[0] + x.shape[axis])[...] = x
    return out


class _Pass:
    """One 1-D pooling pass along ``axis``: window ``k``, ``stride``, ``pad``, ``dilation``."""

    def __init__(self, axis: int, k: int, stride: int, pad: tuple[int, int], dilation: int,
                 n_in: int, n_out: int) -> None:
        self.axis, self.k, self.stride, self.pad, self.dilation = axis, k, stride, pad, dilation
        self.n_in, self.n_out = n_in, n_out
        # The views tile the padded axis exactly: backward writes each once, no zeros.
        self.tiles = stride == k and dilation == 1 and n_in + pad[0] + pad[1] == k * n_out

    def views(self, a: Any) -> list:
        """The ``k`` strided views of padded ``a`` along the axis, each of the output's shape."""
        s, n = self.stride, self.n_out
        return [_take(a, self.axis, j * self.dilation, j * self.dilation + s * (n - 1) + 1, s)
                for j in range(self.k)]

    def padded_empty(self, g: Any, zeros: bool) -> Any:
        xp = get_array_module(g)
        shape = list(g.shape)
        shape[self.axis] = self.n_in + self.pad[0] + self.pad[1]
        return (xp.zeros if zeros else xp.empty)(tuple(shape), dtype=g.dtype)

    def unpad(self, g: Any) -> Any:
        return _take(g, self.axis, self.pad[0], self.pad[0] + self.n_in)


def _passes(x_shape: tuple, kernel: tuple, stride: tuple, pads: tuple, dilation: tuple,
            out: tuple) -> list[_Pass]:
    """The 1-D passes of a box window, last spatial axis first (identity axes skipped)."""
    d = len(kernel)
    passes = []
    for i in reversed(range(d)):
        if kernel[i] == 1 and stride[i] == 1 and not any(pads[i]):
            continue
        passes.append(_Pass(2 + i, kernel[i], stride[i], pads[i], dilation[i],
                            x_shape[2 + i], out[i]))
    return passes


def _tiled_extent(x_shape: tuple, kernel: tuple, stride: tuple, pads: tuple,
                  dilation: tuple, out: tuple) -> tuple | None:
    """The spatial extent the windows tile when they leave input rows or columns unread
    (stride = kernel, no padding or dilation, an odd 7x7 map under 2x2 windows), else None."""
    spatial = x_shape[2:]
    if any(st != k or dl != 1 or any(p) for k, st, p, dl in zip(kernel, stride, pads,
                                                                 dilation)):
        return None
    used = tuple(k * n for k, n in zip(kernel, out))
    return used if used != tuple(spatial) else None


class MaxPool(Function):
    owned_grads = (0,)

    def forward(self, x):
        xp = get_array_module(x)
        # Windows that skip the last row/column: pool a contiguous copy of the part they
        # read, whose views then tile it (backward writes each once, and NumPy runs every
        # pass as one loop instead of one per 3-element row): the cnn's (64, 128, 7, 7)
        # map 3.6 -> 2.6 ms forward + backward, (64, 32, 27, 27) 6.7 -> 4.9 (CPU time,
        # alternating in one process, shared machine), the same numbers bit for bit.
        self.x_shape, self.used = x.shape, _tiled_extent(x.shape, self.kernel, self.stride,
                                                         self.pads, self.dilation, self.out)
        if self.used is not None:
            x = xp.ascontiguousarray(x[(slice(None),) * 2 + tuple(slice(n) for n in self.used)])
        self.passes = _passes(x.shape, self.kernel, self.stride, self.pads, self.dilation,
                              self.out)
        self.winners = []
        y = x
        for p in self.passes:
            views = p.views(_pad_axis(y, p.axis, p.pad, -numpy.inf))
            if p.k == 1:
                self.winners.append(None)
                y = xp.array(views[0], copy=True)
                continue
            # The first maximum wins: a later view only where strictly greater.
            won = views[1] > views[0]
            y = xp.maximum(views[0], views[1])  # NaN propagates
            if p.k > 2:
                won = won.astype(numpy.int8)
                for j, v in enumerate(views[2:], start=2):
                    later = v > y
                    won = xp.where(later, numpy.int8(j), won)
                    xp.maximum(y, v, out=y)
            self.winners.append(won)
        return y if self.passes else xp.array(x, copy=True)

    def backward(self, gy):
        xp = get_array_module(gy)
        g = gy
        for p, won in zip(reversed(self.passes), reversed(self.winners)):
            gin = p.padded_empty(g, zeros=not p.tiles)
            views = p.views(gin)
            if won is not None and won.dtype == numpy.bool_ and p.tiles:
                xp.multiply(g, won, out=views[1])
                xp.subtract(g, views[1], out=views[0])  # g - g*1 = 0, g - g*0 = g exactly
            else:
                if won is None:
                    parts = [g]
                elif won.dtype == numpy.bool_:
                    parts = [None, g * won]
                    parts[0] = g - parts[1]
                else:
                    parts = [g * (won == j) for j in range(p.k)]
                for v, part in zip(views, parts):
                    if p.tiles:  # an empty array whose views are each written once
                        v[...] = part
                    else:
                        v[...] += part
            g = p.unpad(gin)
        if self.used is not None:
            gx = xp.zeros(self.x_shape, dtype=g.dtype)
            gx[(slice(None),) * 2 + tuple(slice(n) for n in self.used)] = g
            return gx
        return xp.ascontiguousarray(g)


class AvgPool(Function):
    owned_grads = (0,)

    def forward(self, x):
        xp = get_array_module(x)
        self.passes = _passes(x.shape, self.kernel, self.stride, self.pads,
                              (1,) * len(self.kernel), self.out)
        self.scales = []
        y = x
        for p in self.passes:
            views = p.views(_pad_axis(y, p.axis, p.pad, 0.0))
            y = xp.array(views[0], copy=True)
            for v in views[1:]:
                y += v
            scale = self._scale(xp, p, x.dtype, y.ndim)
            y *= scale
            self.scales.append(scale)
        return y if self.passes else xp.array(x, copy=True)

    def backward(self, gy):
        xp = get_array_module(gy)
        g = gy
        for p, scale in zip(reversed(self.passes), reversed(self.scales)):
            gs = g * scale
            gin = p.padded_empty(g, zeros=not p.tiles)
            for v in p.views(gin):
                if p.tiles:
                    v[...] = gs
                else:
                    v[...] += gs
            g = p.unpad(gin)
        return xp.ascontiguousarray(g)

    def _scale(self, xp: Any, p: _Pass, dtype: Any, ndim: int) -> Any:
        """``1 / count`` along the pass: the window size, or (without ``count_include_pad``)
        the number of its elements inside the input (a box's count is the product of
        its axes' counts, so the per-pass divisors multiply to the window's)."""
        if self.count_include_pad or not any(p.pad):
            return dtype.type(1.0 / p.k)
        ones = _pad_axis(numpy.ones(p.n_in), 0, p.pad, 0.0)
        counts = sum(_take(ones, 0, j, j + p.stride * (p.n_out - 1) + 1, p.stride)
                     for j in range(p.k))
        shape = [1] * ndim
        shape[p.axis] = p.n_out
        return xp.asarray((1.0 / counts).astype(dtype).reshape(shape))


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
