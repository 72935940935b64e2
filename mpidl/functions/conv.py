"""Convolutions over 1, 2 or 3 spatial axes (one N-d code path), forward and backward.

Layout as PyTorch's: ``x (B, C, *S)``, ``weight (O, C/groups, *K)``, ``y (B, O, *P)``,
so state dicts translate one to one. Cross-correlation (no kernel flip), like every
deep-learning "convolution".

Forward is im2col + GEMM. The unfolded input ``cols (C, *K, B, *P)`` is filled by one
strided copy per kernel offset (``prod(K)`` copies whose inner loop runs along the
output's last axis, never along a kernel axis of 2 or 3 elements), then one GEMM
``weight (O, C*K) @ cols (C*K, B*P)`` (a batched GEMM over groups) gives ``(O, B*P)``,
transposed into ``(B, O, *P)``. Measured on this machine (OpenBLAS, 1 thread): the copies
are 15-30% of the forward, the GEMM the rest; building ``cols`` from
``sliding_window_view`` + ``ascontiguousarray`` instead is no faster (within noise), and
``(B*P, C*K)`` rows need copies whose inner loop is a kernel axis (3 elements), slower.

Backward: ``gW = gy (O, B*P) @ cols.T``; ``gcols = W.T @ gy``, folded back into the
input (col2im) by one strided add per kernel offset; within one offset the output
positions map to distinct input positions, so ``+=`` on a view needs no scatter-add.

Memory: ``cols`` is ``prod(K)`` times the input, so it is built in chunks of at most
:data:`COLS_BYTES`: whole samples while they fit, else slabs of output rows of one
sample (along the first spatial axis; a 128^3 CosmoFlow volume with 32 channels and a
2^3 kernel is 2 GiB unfolded). When the whole batch fits in one chunk, forward keeps
``cols`` for backward (saving the rebuild, 15-30% of forward); otherwise backward
rebuilds each chunk from the padded input.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module

# Largest unfolded chunk (bytes). 64 MiB holds the reference cnn and cosmoflow batches in
# one chunk; a bigger volume is processed a chunk at a time (and backward rebuilds it).
COLS_BYTES = 64 << 20


def ntuple(value: Any, d: int, name: str) -> tuple[int, ...]:
    """``value`` as a tuple of ``d`` ints (an int is repeated), checked to be >= 0."""
    if isinstance(value, int):
        out = (value,) * d
    else:
        out = tuple(int(v) for v in value)
        if len(out) != d:
            raise ValueError(f"{name}={tuple(value)} has {len(out)} entries; this op has "
                             f"{d} spatial axes")
    if any(v < 0 for v in out):
        raise ValueError(f"{name}={out} must not be negative")
    return out


def conv_padding(padding: Any, kernel: Sequence[int], dilation: Sequence[int],
                 stride: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per spatial axis ``(before, after)`` zero padding, PyTorch's meaning of ``padding``.

    An int or a tuple pads both sides equally; ``"valid"`` is no padding; ``"same"``
    (stride 1 only) keeps the input size, and for an even total ``dilation * (k - 1)``
    pads the extra element after (as PyTorch does).
    """
    d = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * d
        if padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError(f"padding='same' needs stride 1, got stride={tuple(stride)}")
            out = []
            for k, dl in zip(kernel, dilation):
                total = dl * (k - 1)
                out.append((total // 2, total - total // 2))
            return tuple(out)
        raise ValueError(f"padding={padding!r}: use an int, a tuple, 'valid' or 'same'")
    return tuple((p, p) for p in ntuple(padding, d, "padding"))


def output_size(size: int, kernel: int, stride: int, pad: tuple[int, int], dilation: int) -> int:
    """Output length of one axis: ``floor((S + pads - dilation (k - 1) - 1) / stride) + 1``."""
    return (size + pad[0] + pad[1] - dilation * (kernel - 1) - 1) // stride + 1


def pad_input(x: Any, pads: Sequence[tuple[int, int]], value: float = 0.0) -> Any:
    """``x (B, C, *S)`` with its spatial axes padded by ``value`` (x itself if no padding)."""
    if not any(a or b for a, b in pads):
        return x
    xp = get_array_module(x)
    shape = x.shape[:2] + tuple(s + a + b for s, (a, b) in zip(x.shape[2:], pads))
    out = xp.full(shape, value, dtype=x.dtype) if value else xp.zeros(shape, dtype=x.dtype)
    out[(slice(None), slice(None)) + tuple(slice(a, a + s) for s, (a, _) in
                                           zip(x.shape[2:], pads))] = x
    return out


def unpad(x: Any, pads: Sequence[tuple[int, int]]) -> Any:
    """The inverse of :func:`pad_input`: the interior of ``x``, as a contiguous array."""
    if not any(a or b for a, b in pads):
        return x
    xp = get_array_module(x)
    inner = tuple(slice(a, n - b) for n, (a, b) in zip(x.shape[2:], pads))
    return xp.ascontiguousarray(x[(slice(None), slice(None)) + inner])


def window_slices(offset: Sequence[int], dilation: Sequence[int], stride: Sequence[int],
                  out: Sequence[int], first: int = 0) -> tuple[slice, ...]:
    """Spatial slices of the padded input that kernel ``offset`` sees at every output
    position; ``first`` is the first output row (along the first spatial axis)."""
    sl = []
    for axis, (o, dl, s, n) in enumerate(zip(offset, dilation, stride, out)):
        start = o * dl + (first * s if axis == 0 else 0)
        sl.append(slice(start, start + s * (n - 1) + 1, s))
    return tuple(sl)


def _chunks(batch: int, out: tuple[int, ...], per_position: int, itemsize: int
            ) -> list[tuple[int, int, int, int]]:
    """``(b0, b1, r0, r1)``: samples ``b0:b1``, output rows ``r0:r1`` of the first axis."""
    budget = max(1, COLS_BYTES // itemsize)
    per_row = per_position * math.prod(out[1:])
    per_sample = per_row * out[0]
    if batch * per_sample <= budget or batch == 0:
        return [(0, batch, 0, out[0])]
    if per_sample <= budget:
        step = budget // per_sample
        return [(b, min(b + step, batch), 0, out[0]) for b in range(0, batch, step)]
    rows = max(1, budget // per_row)
    return [(b, b + 1, r, min(r + rows, out[0])) for b in range(batch)
            for r in range(0, out[0], rows)]


class Convolution(Function):
    """``y = x * weight + bias`` (cross-correlation) over ``d = weight.ndim - 2`` axes."""

    owned_grads = (0, 1, 2)  # unpadded copies, GEMM results and sums: fresh arrays

    def forward(self, x, weight, bias):
        xp = get_array_module(x, weight)
        d = weight.ndim - 2
        self.d, self.x_shape = d, x.shape
        kernel = weight.shape[2:]
        self.out = tuple(output_size(s, k, st, p, dl) for s, k, st, p, dl in
                         zip(x.shape[2:], kernel, self.stride, self.pads, self.dilation))
        b, c = x.shape[:2]
        o = weight.shape[0]
        xpad = pad_input(x, self.pads)
        chunks = _chunks(b, self.out, c * math.prod(kernel), x.dtype.itemsize)
        y = xp.empty((b, o) + self.out, dtype=x.dtype)
        cols = None
        for chunk in chunks:
            cols = self._im2col(xpad, kernel, chunk)
            y2 = self._gemm(weight, cols)  # (O, Bc*Pc)
            if bias is not None:
                y2 += bias[:, None]
            self._put(y, y2, chunk)
        self.weight, self.chunks = weight, chunks
        # One chunk: keep it for backward; several: backward rebuilds each from xpad.
        self.cols, self.xpad = (cols, None) if len(chunks) == 1 else (None, xpad)
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        nx, nw, nb = self.needs_input_grad
        weight, g = self.weight, self.groups
        o = weight.shape[0]
        kernel = weight.shape[2:]
        b, c = self.x_shape[:2]
        gb = gw = gx = gxpad = None
        if nb:
            gy3 = gy.reshape(b, o, math.prod(gy.shape[2:]))  # (B, O, P); not -1: B may be 0
            gb = xp.matmul(gy3, xp.ones(gy3.shape[2], dtype=gy.dtype)).sum(axis=0)  # (O,)
        if not (nx or nw):
            return None, None, gb
        if nx:
            spatial = tuple(s + p + q for s, (p, q) in zip(self.x_shape[2:], self.pads))
            gxpad = xp.zeros((b, c) + spatial, dtype=gy.dtype)
        single = len(self.chunks) == 1
        w3 = weight.reshape(g, o // g, -1)  # (g, Og, Cg*K)
        for chunk in self.chunks:
            b0, b1, r0, r1 = chunk
            cols = self.cols if single else self._im2col(self.xpad, kernel, chunk)
            sel = (slice(b0, b1), slice(None), slice(r0, r1))
            # (O, Bc * Pc) contiguous, the GEMMs' layout
            n = (b1 - b0) * (r1 - r0) * math.prod(self.out[1:])
            gy2 = xp.ascontiguousarray(xp.swapaxes(gy[sel], 0, 1)).reshape(g, o // g, n)
            if nw:
                cols3 = cols.reshape(g, w3.shape[2], n)  # (g, Cg*K, N)
                # The first (only) chunk may write into the data-parallel bucket slice.
                buf = self.grad_buffer_for(1) if single else None
                if g == 1:
                    part = xp.matmul(gy2[0], cols3[0].T,
                                     out=None if buf is None else buf.reshape(o, -1))
                else:
                    part = xp.matmul(gy2, xp.swapaxes(cols3, 1, 2),
                                     out=None if buf is None else buf.reshape(w3.shape))
                if gw is None:
                    gw = buf if buf is not None else part.reshape(weight.shape)
                else:
                    gw += part.reshape(weight.shape)
            if nx:
                if g == 1:
                    gcols = xp.matmul(w3[0].T, gy2[0])  # (C*K, N)
                else:
                    gcols = xp.matmul(xp.swapaxes(w3, 1, 2), gy2)  # (g, Cg*K, N)
                self._col2im(gxpad, gcols.reshape(cols.shape), kernel, chunk)
                del gcols
            del cols
        if nx:
            gx = unpad(gxpad, self.pads)
        return gx, gw, gb

    # -- pieces ------------------------------------------------------------------------
    def _chunk_out(self, chunk: tuple[int, int, int, int]) -> tuple[int, ...]:
        return (chunk[3] - chunk[2],) + self.out[1:]

    def _im2col(self, xpad: Any, kernel: tuple[int, ...], chunk: tuple) -> Any:
        """``cols (C, *K, Bc, *Pc)`` of one chunk of the padded input."""
        xp = get_array_module(xpad)
        b0, b1, r0, _ = chunk
        out = self._chunk_out(chunk)
        c = xpad.shape[1]
        cols = xp.empty((c,) + tuple(kernel) + (b1 - b0,) + out, dtype=xpad.dtype)
        xt = xp.swapaxes(xpad[b0:b1], 0, 1)  # (C, Bc, *Sp), a view
        for offset in itertools.product(*(range(k) for k in kernel)):
            sl = window_slices(offset, self.dilation, self.stride, out, r0)
            cols[(slice(None),) + offset] = xt[(slice(None), slice(None)) + sl]
        return cols

    def _col2im(self, gxpad: Any, gcols: Any, kernel: tuple[int, ...], chunk: tuple) -> None:
        """Add ``gcols (C, *K, Bc, *Pc)`` back onto the padded input gradient."""
        xp = get_array_module(gxpad)
        b0, b1, r0, _ = chunk
        out = self._chunk_out(chunk)
        gt = xp.swapaxes(gxpad[b0:b1], 0, 1)  # (C, Bc, *Sp), a view
        for offset in itertools.product(*(range(k) for k in kernel)):
            sl = window_slices(offset, self.dilation, self.stride, out, r0)
            gt[(slice(None), slice(None)) + sl] += gcols[(slice(None),) + offset]

    def _gemm(self, weight: Any, cols: Any) -> Any:
        """``(O, Bc*Pc)``: the groups' ``W_g (Og, Cg*K) @ cols_g (Cg*K, N)`` stacked."""
        xp = get_array_module(weight, cols)
        g, o = self.groups, weight.shape[0]
        n = math.prod(cols.shape[1 + self.d:])
        ck = math.prod(cols.shape[:1 + self.d])  # C * prod(K); not -1: N may be 0
        if g == 1:
            return xp.matmul(weight.reshape(o, ck), cols.reshape(ck, n))
        y3 = xp.matmul(weight.reshape(g, o // g, ck // g), cols.reshape(g, ck // g, n))
        return y3.reshape(o, n)

    def _put(self, y: Any, y2: Any, chunk: tuple) -> None:
        """Write ``y2 (O, Bc*Pc)`` into ``y (B, O, *P)`` at the chunk's place."""
        xp = get_array_module(y)
        b0, b1, r0, r1 = chunk
        o = y.shape[1]
        y4 = y2.reshape((o, b1 - b0) + self._chunk_out(chunk))
        y[b0:b1, :, r0:r1] = xp.swapaxes(y4, 0, 1)


def convolution(x: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
                dilation: Any = 1, groups: int = 1) -> Tensor:
    """N-d convolution (cross-correlation) with ``d = weight.ndim - 2`` spatial axes.

    Args:
        x: ``(B, C, *S)`` input.
        weight: ``(O, C // groups, *K)``.
        bias: ``(O,)`` or None.
        stride, dilation: an int or one int per spatial axis (>= 1).
        padding: zero padding: an int or one per axis (both sides), ``"valid"`` (none)
            or ``"same"`` (output size = input size; stride 1 only).
        groups: split the channels into this many independent groups (``C`` and ``O``
            divisible by it; ``groups == C`` is a depthwise convolution).

    Returns:
        ``(B, O, *P)`` with ``P = floor((S + 2 pad - dilation (K - 1) - 1) / stride) + 1``.
    """
    d = weight.ndim - 2
    if d < 1:
        raise ValueError(f"convolution: weight of shape {tuple(weight.shape)} has no spatial "
                         "axes; expected (out_channels, in_channels // groups, *kernel)")
    if x.ndim != d + 2:
        raise ValueError(f"conv{d}d: input of shape {tuple(x.shape)} must be (B, C) + {d} "
                         f"spatial axes ({d + 2} dimensions) for a weight of shape "
                         f"{tuple(weight.shape)}")
    stride = ntuple(stride, d, "stride")
    dilation = ntuple(dilation, d, "dilation")
    if min(stride) < 1 or min(dilation) < 1:
        raise ValueError(f"conv{d}d: stride={stride} and dilation={dilation} must be >= 1")
    groups = int(groups)
    c, o = x.shape[1], weight.shape[0]
    if groups < 1 or c % groups or o % groups:
        raise ValueError(f"conv{d}d: groups={groups} must divide in_channels={c} and "
                         f"out_channels={o}")
    if weight.shape[1] * groups != c:
        raise ValueError(f"conv{d}d: input has {c} channels but the weight "
                         f"{tuple(weight.shape)} with groups={groups} expects "
                         f"{weight.shape[1] * groups}")
    if bias is not None and tuple(bias.shape) != (o,):
        raise ValueError(f"conv{d}d: bias has shape {tuple(bias.shape)}, expected ({o},)")
    kernel = tuple(weight.shape[2:])
    pads = conv_padding(padding, kernel, dilation, stride)
    out = [output_size(s, k, st, p, dl) for s, k, st, p, dl in
           zip(x.shape[2:], kernel, stride, pads, dilation)]
    if min(out) < 1:
        raise ValueError(f"conv{d}d: input spatial size {tuple(x.shape[2:])} is smaller than "
                         f"the dilated kernel {kernel} (dilation {dilation}, padding "
                         f"{[p for p, _ in pads]}): the output would be {tuple(out)}")
    return Convolution.apply(x, weight, bias, stride=stride, pads=pads, dilation=dilation,
                             groups=groups)


def conv1d(x: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """1-D convolution: ``x (B, C, L)``, ``weight (O, C/groups, K)`` (see :func:`convolution`)."""
    _check_axes(weight, 1)
    return convolution(x, weight, bias, stride, padding, dilation, groups)


def conv2d(x: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """2-D convolution: ``x (B, C, H, W)``, ``weight (O, C/groups, KH, KW)``."""
    _check_axes(weight, 2)
    return convolution(x, weight, bias, stride, padding, dilation, groups)


def conv3d(x: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
           dilation: Any = 1, groups: int = 1) -> Tensor:
    """3-D convolution: ``x (B, C, D, H, W)``, ``weight (O, C/groups, KD, KH, KW)``."""
    _check_axes(weight, 3)
    return convolution(x, weight, bias, stride, padding, dilation, groups)


def _check_axes(weight: Any, d: int) -> None:
    if weight.ndim != d + 2:
        raise ValueError(f"conv{d}d: weight of shape {tuple(weight.shape)} must have "
                         f"{d + 2} dimensions (out_channels, in_channels // groups, "
                         f"{d} kernel sizes)")
