"""Convolutions over 1, 2 or 3 spatial axes (one N-d code path), forward and backward.

Layout as PyTorch's: ``x (B, C, *S)``, ``weight (O, C/groups, *K)``, ``y (B, O, *P)``,
so state dicts translate one to one. Cross-correlation (no kernel flip), like every
deep-learning "convolution".

Forward is im2col + GEMM. The unfolded input ``cols (C, *K, B, *P)`` is filled by one
strided copy per kernel offset (``prod(K)`` copies whose inner loop runs along the
output's rows, never along a kernel axis of 2 or 3 elements), then one GEMM ``weight
(O, C*K) @ cols (C*K, B*P)`` (a batched GEMM over groups) gives ``(O, B*P)``, transposed
into ``(B, O, *P)``. Building ``cols`` from ``sliding_window_view`` +
``ascontiguousarray`` measured no faster, and ``(B*P, C*K)`` rows need copies whose
inner loop is a kernel axis (3 elements), slower. 'Same' layers with stride 1 (the
reference models') copy whole planes instead of rows (:class:`FlatRows`): 2-3x faster
copies at the cnn's 14x14 and 7x7 maps; unfolded whole samples at a time (every layer of
the reference models at their batch sizes) they copy and add one shifted run per channel
and offset instead (:class:`FlatPlanes`): col2im 3.5x faster on the cnn's 14x14 layer.

Backward: ``gW = gy (O, B*P) @ cols.T``; ``gcols = W.T @ gy`` (written over ``cols``),
folded back into the input (col2im) by one strided add per kernel offset; within one
offset the output positions map to distinct input positions, so ``+=`` on a view needs
no scatter-add.

Memory: ``cols`` is ``prod(K)`` times the input, so it is built in chunks of at most
:data:`COLS_BYTES`: whole samples while they fit, else slabs of output rows of one
sample (along the first spatial axis; a 128^3 CosmoFlow volume with 32 channels and a
2^3 kernel is 2 GiB unfolded). A layer whose whole unfolding is small (at most
:data:`KEEP_COLS_BYTES`: the cnn's layers) keeps it from forward for the weight
gradient. A larger one outlives neither its forward nor its backward: backward unfolds
the input (held by the graph anyway) again, chunk by chunk, so a network of any depth
on large volumes holds at most one chunk. Keeping every unfolding cost page faults
under glibc's default heap thresholds (10,300 faults and 94 ms per cnn step kept,
6,500 and 86 ms rebuilt) until :func:`raise_heap_threshold`.
"""
from __future__ import annotations

import itertools
import math
import threading
from typing import Any, Sequence

import numpy

from mpidl.autograd import Function, Tensor, is_grad_enabled
from mpidl.backend import get_array_module

# The weight gradient as (cols @ gy^T)^T rather than gy @ cols^T from this many rows of
# cols (C*K) up: OpenBLAS ran the cnn's and cosmoflow's (O, C*K) = (64, 288), (128, 576),
# (64, 256) shapes 3-15% faster that way, and the small first layers (C*K = 9, 27)
# 15-25% slower.
_GW_TRANSPOSED_FROM = 64

# Forward as one GEMM per sample written straight into y (B, O, P) from this many output
# positions P up (NumPy), instead of one GEMM (O, B*P) and a transposing copy: the cnn's first
# layer (P = 784) 1.17 -> 0.35 ms, its second (196) 6.2 -> 5.9 ms, cosmoflow's first
# two (32768, 4096) 4-5% faster; its third layer (P = 49) is 20% slower per sample.
_PER_SAMPLE_GEMM_FROM = 128

# Backward per sample from this many output positions up: the input's unfolded gradient
# W^T gy[b] written through a strided view of cols, and (for C*K < 64) the weight gradient
# as sum_b gy[b] cols[:, b]^T, neither needing gy transposed to (O, B*P). cnn's first layer
# (P = 784, C*K = 9): weight gradient 1.2 -> 0.33 ms; cosmoflow's first two layers
# (32768, 4096): input gradient 18 -> 13 and 20 -> 16.5 ms. At P = 196 and 49 (cnn's
# other layers) both ran 10-50% slower.
_PER_SAMPLE_BACKWARD_FROM = 512

# An unfolded input of at most this many bytes (the whole batch in one chunk) is kept
# from forward for the weight gradient instead of being unfolded again in backward:
# the cnn's 14x14 layer (14.4 MB) 46.5 -> 43.2 ms per forward + backward, its 7x7
# layer 35.3 -> 32.8, a cnn step 3% (CPU time, alternating, loaded machine). Larger ones
# (cosmoflow's first layers, 34 MB at batch 8) are unfolded again, so a deep network
# on large volumes holds one chunk at a time. Below _SCRATCH_FROM: a kept unfolding is
# never the shared buffer.
KEEP_COLS_BYTES = 16 << 20

# Largest unfolded chunk (bytes). 64 MiB holds the reference cnn and cosmoflow batches in
# one chunk; a bigger volume is processed a chunk at a time.
COLS_BYTES = 64 << 20


_scratch = threading.local()

# glibc serves a request of 32 MiB or more (the ceiling of its dynamic mmap threshold,
# mallopt(3) on 64-bit) with a fresh mmap, faulted in page by page at every allocation,
# whatever the heap policy; smaller ones come from the heap, which reuses them.
_SCRATCH_FROM = 32 << 20


def scratch(xp: Any, shape: tuple, dtype: Any) -> Any:
    """An uninitialised ``shape`` array for the unfolded input (``cols``, ``gcols``).

    Those live only inside one forward or backward, so the large ones (32 MiB and up:
    cosmoflow's first two layers at batch 8) share one buffer per thread, grown to the
    largest chunk (at most :data:`COLS_BYTES`) and kept: 162-164 ms against 174-197 ms
    per cosmoflow step. Smaller ones are plain allocations: a kept buffer holds the
    heap's dynamic mmap threshold down, and the cnn's step (15 MB chunks) then
    page-faulted more (9,000 against 7,000 faults, +5 ms). NumPy only: CuPy's memory pool
    already reuses device memory. :func:`release_scratch` frees the buffer.
    """
    dtype = numpy.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if xp is not numpy or nbytes < _SCRATCH_FROM:
        return xp.empty(shape, dtype=dtype)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _scratch.buf = numpy.empty(nbytes, dtype=numpy.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def release_scratch() -> None:
    """Free this thread's unfolding buffer (it is allocated again when needed)."""
    _scratch.buf = None


# Just under glibc's 32 MiB ceiling for its dynamic mmap threshold (a freed mmapped
# chunk above the ceiling leaves the thresholds as they are).
_HEAP_RAISE_BYTES = 31 << 20
_heap_raised = False


def raise_heap_threshold() -> None:
    """Raise glibc's dynamic heap thresholds once per process, as freeing a 31 MiB array does.

    glibc serves a request above its mmap threshold (128 KiB at start) with a fresh
    mmap, and when such a chunk is freed it raises the threshold to the chunk's size
    and the heap's trim threshold to twice that (mallopt(3), "dynamic mmap threshold").
    A training step allocates its activations and frees them at the end of backward;
    each step the heap's free top beyond the trim threshold goes back to the kernel and
    is faulted in again, page by page, in the next forward: the reference cnn's step
    took 6,500 page faults (26 MB) with the thresholds its own arrays had set (14 MB
    and 28 MB), and 1 after one 31 MiB allocation freed at start (31 and 62 MiB);
    148.6 -> 117.9 ms of CPU per step under load (conv.py's --malloc keep sets both
    thresholds outright, process-wide, as DataParallel does). This allocates and frees
    31 MiB of untouched memory (nothing is faulted in) the first time a NumPy
    convolution runs. It changes nothing where the user fixed the thresholds
    (``MALLOC_MMAP_THRESHOLD_`` or mallopt turn the dynamic adjustment off) or where
    the C library is not glibc; the process keeps at most 62 MiB of freed heap.
    """
    global _heap_raised
    if not _heap_raised:
        _heap_raised = True
        del_me = numpy.empty(_HEAP_RAISE_BYTES, dtype=numpy.uint8)
        del del_me


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


class Windows:
    """How a chunk of the input is unfolded into ``cols (C, *K, Bc, *Pc)`` and folded back.

    The general geometry: the input is zero-padded on every spatial axis, and each
    kernel offset is one strided view with the output's shape. NumPy runs such a copy
    (or add) as one inner loop per output row, so with rows of 7-14 elements its cost
    is the loop overhead (10 ns a row measured, 7x a contiguous copy of the same bytes).
    """

    def __init__(self, conv: "Convolution", x_shape: tuple, kernel: tuple) -> None:
        self.conv, self.x_shape, self.kernel = conv, x_shape, kernel
        self.offsets = list(itertools.product(*(range(k) for k in kernel)))

    def pad(self, x: Any) -> Any:
        return pad_input(x, self.conv.pads)

    def zeros(self, dtype: Any, xp: Any) -> Any:
        """A zero input gradient in the padded layout."""
        spatial = tuple(s + p + q for s, (p, q) in zip(self.x_shape[2:], self.conv.pads))
        return xp.zeros(self.x_shape[:2] + spatial, dtype=dtype)

    def unpad(self, gxpad: Any) -> Any:
        return unpad(gxpad, self.conv.pads)

    def _views(self, padded: Any, chunk: tuple) -> Any:
        """Per offset: (the offset, its view of the padded array ``(C, Bc, *Pc)``)."""
        xp = get_array_module(padded)
        b0, b1, r0, _ = chunk
        out = self.conv._chunk_out(chunk)
        t = xp.swapaxes(padded[b0:b1], 0, 1)  # (C, Bc, *Sp), a view
        for offset in self.offsets:
            sl = window_slices(offset, self.conv.dilation, self.conv.stride, out, r0)
            yield offset, t[(slice(None), slice(None)) + sl]

    def im2col(self, xpad: Any, chunk: tuple) -> Any:
        """``cols (C, *K, Bc, *Pc)`` of one chunk of the padded input."""
        xp = get_array_module(xpad)
        c, bc = xpad.shape[1], chunk[1] - chunk[0]
        cols = scratch(xp, (c,) + tuple(self.kernel) + (bc,) + self.conv._chunk_out(chunk),
                       xpad.dtype)
        for offset, view in self._views(xpad, chunk):
            cols[(slice(None),) + offset] = view
        return cols

    def col2im(self, gxpad: Any, gcols: Any, chunk: tuple) -> None:
        """Add ``gcols (C, *K, Bc, *Pc)`` back onto the padded input gradient."""
        for offset, view in self._views(gxpad, chunk):
            view += gcols[(slice(None),) + offset]


class FlatRows(Windows):
    """The geometry of 'same' convolutions with stride 1 on the last two axes (the
    reference models' 3x3 and 2^3 'same' layers): the output rows are as wide as the
    input's, so one kernel offset's view of a (row, column) plane is one contiguous run
    of the flattened plane, shifted by the column offset. The last axis is not padded;
    each plane has one zero row before and after it (a margin for the shift), and the
    columns that the shift wraps into the neighbouring row (the padding positions) are
    zeroed in ``cols`` after the copy, and in ``gcols`` before the add. The copies and
    adds then run along planes instead of rows: on the cnn's 14x14 (7x7) layer, im2col
    1.5 -> 0.7 ms (1.3 -> 0.5) and col2im 3.8 -> 1.9 ms (4.0 -> 1.4).

    Only slicing and reshapes of contiguous arrays make the views written through (a
    reshape of a strided view may be a copy, in CuPy as in NumPy).
    """

    @staticmethod
    def applies(conv: "Convolution", x_shape: tuple, kernel: tuple) -> bool:
        d = len(kernel)
        (lo, hi), dl = conv.pads[-1], conv.dilation[-1]
        return (d >= 2 and conv.stride[-1] == 1 and conv.stride[-2] == 1
                and lo + hi == dl * (kernel[-1] - 1) and x_shape[-1] > max(lo, hi))

    def __init__(self, conv: "Convolution", x_shape: tuple, kernel: tuple) -> None:
        super().__init__(conv, x_shape, kernel)
        self.w = x_shape[-1]
        self.lo = conv.pads[-1][0]
        # padded sizes of every spatial axis but the last, plus the two margin rows
        outer = [s + p + q for s, (p, q) in zip(x_shape[2:-1], conv.pads[:-1])]
        outer[-1] += 2
        self.shape = x_shape[:2] + tuple(outer) + (self.w,)  # the padded layout

    def _interior(self) -> tuple:
        pads = list(self.conv.pads[:-1])
        pads[-1] = (pads[-1][0] + 1, pads[-1][1] + 1)  # past the margin row
        return (slice(None), slice(None)) + tuple(
            slice(p, p + s) for s, (p, _) in zip(self.x_shape[2:-1], pads))

    def pad(self, x: Any) -> Any:
        xp = get_array_module(x)
        buf = xp.zeros(self.shape, dtype=x.dtype)
        buf[self._interior()] = x
        return buf

    def zeros(self, dtype: Any, xp: Any) -> Any:
        return xp.zeros(self.shape, dtype=dtype)

    def unpad(self, gxpad: Any) -> Any:
        xp = get_array_module(gxpad)
        return xp.ascontiguousarray(gxpad[self._interior()])

    def _flat(self, a: Any, lead: tuple, rows: int) -> Any:
        """Contiguous ``a`` with its last two axes (rows, W) merged: always a view."""
        return a.reshape(lead + (rows * self.w,))

    def _runs(self, padded: Any, chunk: tuple) -> Any:
        """Per offset: (the offset, its runs ``(C, Bc, *Pc[:-2], rows * W)``, the shift)."""
        xp = get_array_module(padded)
        conv, w = self.conv, self.w
        b0, b1, r0, _ = chunk
        out = conv._chunk_out(chunk)
        d = len(self.kernel)
        flat = self._flat(padded, padded.shape[:-2], padded.shape[-2])
        t = xp.swapaxes(flat[b0:b1], 0, 1)  # (C, Bc, *outer[:-1], rows * W), a view
        for offset in self.offsets:
            sl = list(window_slices(offset[:-2], conv.dilation, conv.stride, out[:-2], r0))
            row = 1 + offset[-2] * conv.dilation[-2] + (r0 if d == 2 else 0)
            shift = offset[-1] * conv.dilation[-1] - self.lo
            start = row * w + shift
            sl.append(slice(start, start + out[-2] * w))
            yield offset, t[(slice(None), slice(None)) + tuple(sl)], shift

    def _wrapped(self, block: Any, shift: int) -> Any:
        """The columns of ``block (..., W)`` that a ``shift`` took from the next/previous row."""
        return block[..., :-shift] if shift < 0 else block[..., self.w - shift:]

    def im2col(self, xpad: Any, chunk: tuple) -> Any:
        xp = get_array_module(xpad)
        c, bc = xpad.shape[1], chunk[1] - chunk[0]
        out = self.conv._chunk_out(chunk)
        lead = (c,) + tuple(self.kernel) + (bc,) + out[:-2]
        cols = scratch(xp, lead + out[-2:], xpad.dtype)
        flat = self._flat(cols, lead, out[-2])
        for offset, runs, shift in self._runs(xpad, chunk):
            flat[(slice(None),) + offset] = runs
            if shift:
                self._wrapped(cols[(slice(None),) + offset], shift)[...] = 0
        return cols

    def col2im(self, gxpad: Any, gcols: Any, chunk: tuple) -> None:
        out = self.conv._chunk_out(chunk)
        flat = self._flat(gcols, gcols.shape[:-2], out[-2])  # gcols is contiguous
        for offset, runs, shift in self._runs(gxpad, chunk):
            if shift:  # padding positions: add nothing
                self._wrapped(gcols[(slice(None),) + offset], shift)[...] = 0
            runs += flat[(slice(None),) + offset]


class FlatPlanes(Windows):
    """'Same' convolutions with stride 1 on every axis, unfolded a whole sample at a time
    (the cnn's 3x3 layers): the input is transposed once to ``(C, B*P)``, so that every
    channel's positions, sample after sample, are one contiguous run (output positions
    and input positions coincide), and a kernel offset's view of it is the same run
    shifted by ``s = sum_a (k_a d_a - lo_a) * prod(S[a+1:])``. im2col is then one shifted copy
    per offset (``C`` runs of ``B*P`` elements) and col2im one shifted add into a
    ``(C, B*P)`` accumulator; the positions a shift takes from a neighbouring row, plane
    or sample are the padding positions, zeroed in ``cols`` after the copy and in ``gcols``
    before the add. No padded copy of the input: the shift's ends are clipped. NumPy runs
    a ufunc over runs of a few hundred elements at about 70 ns a run (its buffered
    iteration): on the cnn's 14x14 layer (2,048 planes of 196 per offset) col2im's adds
    took 2.7 ms as :class:`FlatRows`' per-plane runs and 0.8 ms as one run per channel.
    """

    @staticmethod
    def applies(conv: "Convolution", x_shape: tuple, kernel: tuple, chunks: list) -> bool:
        return (all(s == 1 for s in conv.stride)
                and all(lo + hi == dl * (k - 1) for (lo, hi), dl, k in
                        zip(conv.pads, conv.dilation, kernel))
                and all(r0 == 0 and r1 == conv.out[0] for _, _, r0, r1 in chunks))

    def __init__(self, conv: "Convolution", x_shape: tuple, kernel: tuple) -> None:
        super().__init__(conv, x_shape, kernel)
        spatial = x_shape[2:]
        self.p = math.prod(spatial)
        inner = [math.prod(spatial[a + 1:]) for a in range(len(spatial))]
        self.shifts = []  # per offset: its flat shift, and (axis, first, last) invalid rows
        for offset in self.offsets:
            s, edges = 0, []
            for a, (k, dl, (lo, _), n) in enumerate(zip(offset, conv.dilation, conv.pads,
                                                         spatial)):
                move = k * dl - lo  # output index i reads input index i + move
                s += move * inner[a]
                edges.append((a, min(max(-move, 0), n), min(max(move, 0), n)))
            self.shifts.append((s, edges))

    def pad(self, x: Any) -> Any:
        """``x (B, C, *S)`` as ``(C, B*P)``, contiguous."""
        xp = get_array_module(x)
        b, c = x.shape[:2]
        return xp.ascontiguousarray(xp.swapaxes(x.reshape(b, c, self.p), 0, 1)).reshape(
            c, b * self.p)

    def zeros(self, dtype: Any, xp: Any) -> Any:
        b, c = self.x_shape[:2]
        return xp.zeros((c, b * self.p), dtype=dtype)

    def unpad(self, acc: Any) -> Any:
        xp = get_array_module(acc)
        c, b = self.x_shape[1], self.x_shape[0]
        return xp.ascontiguousarray(xp.swapaxes(acc.reshape((c, b) + self.x_shape[2:]), 0, 1))

    def _zero_padding(self, block: Any, edges: list) -> None:
        """Zero the positions of ``block (C, Bc, *P)`` whose input lies in the padding."""
        for a, first, last in edges:
            lead = (slice(None),) * (2 + a)
            if first:
                block[lead + (slice(0, first),)] = 0
            if last:
                block[lead + (slice(block.shape[2 + a] - last, None),)] = 0

    def _span(self, chunk: tuple, s: int, total: int) -> tuple[int, int, int, int]:
        """The shifted run's part inside the input ``[a, z)`` and where it starts and
        ends in the chunk's run ``[a - lo, z - lo)``."""
        lo = chunk[0] * self.p + s
        hi = chunk[1] * self.p + s
        a, z = max(lo, 0), min(hi, total)
        return a, z, a - lo, z - lo

    def im2col(self, xt: Any, chunk: tuple) -> Any:
        xp = get_array_module(xt)
        c, total = xt.shape
        bc = chunk[1] - chunk[0]
        n = bc * self.p
        cols = scratch(xp, (c,) + tuple(self.kernel) + (bc,) + self.conv.out, xt.dtype)
        flat = cols.reshape(c, len(self.offsets), n)
        for i, (offset, (s, edges)) in enumerate(zip(self.offsets, self.shifts)):
            a, z, u, v = self._span(chunk, s, total)
            run = flat[:, i]
            if z > a:
                run[:, u:v] = xt[:, a:z]
            run[:, :max(u, 0)] = 0
            run[:, max(v, u, 0):] = 0
            self._zero_padding(cols[(slice(None),) + offset], edges)
        return cols

    def col2im(self, acc: Any, gcols: Any, chunk: tuple) -> None:
        c, total = acc.shape
        n = (chunk[1] - chunk[0]) * self.p
        flat = gcols.reshape(c, len(self.offsets), n)  # gcols is contiguous
        for i, (offset, (s, edges)) in enumerate(zip(self.offsets, self.shifts)):
            a, z, u, v = self._span(chunk, s, total)
            if z > a:
                self._zero_padding(gcols[(slice(None),) + offset], edges)
                acc[:, a:z] += flat[:, i, u:v]


class Convolution(Function):
    """``y = x * weight + bias`` (cross-correlation) over ``d = weight.ndim - 2`` axes."""

    owned_grads = (0, 1, 2)  # unpadded copies, GEMM results and sums: fresh arrays

    def forward(self, x, weight, bias):
        xp = get_array_module(x, weight)
        if xp is numpy:
            raise_heap_threshold()
        d = weight.ndim - 2
        self.d, self.x_shape = d, x.shape
        kernel = weight.shape[2:]
        self.out = tuple(output_size(s, k, st, p, dl) for s, k, st, p, dl in
                         zip(x.shape[2:], kernel, self.stride, self.pads, self.dilation))
        b, c = x.shape[:2]
        o = weight.shape[0]
        self.chunks = _chunks(b, self.out, c * math.prod(kernel), x.dtype.itemsize)
        if FlatPlanes.applies(self, x.shape, kernel, self.chunks):
            geometry = FlatPlanes
        else:
            geometry = FlatRows if FlatRows.applies(self, x.shape, kernel) else Windows
        self.unfold = geometry(self, x.shape, kernel)
        xpad = self.unfold.pad(x)
        y = xp.empty((b, o) + self.out, dtype=x.dtype)
        positions = math.prod(self.out)
        self.cols = None
        for chunk in self.chunks:
            cols = self.unfold.im2col(xpad, chunk)
            if (self.keep_cols and len(self.chunks) == 1 and cols.nbytes <= KEEP_COLS_BYTES
                    and cols.nbytes < _SCRATCH_FROM):  # not the shared buffer
                self.cols = cols  # for the weight gradient (see KEEP_COLS_BYTES)
            b0, b1, r0, r1 = chunk
            if self._per_sample(xp, chunk, _PER_SAMPLE_GEMM_FROM):
                # One GEMM per sample, (O, C*K) @ cols[:, b] (C*K, P), straight into y.
                ck = weight[0].size  # C * prod(K)
                y3 = y[b0:b1].reshape(b1 - b0, o, positions)
                xp.matmul(weight.reshape(o, ck), xp.swapaxes(
                    cols.reshape(ck, b1 - b0, positions), 0, 1), out=y3)
                if bias is not None:
                    y3 += bias[:, None]
                continue
            y2 = self._gemm(weight, cols)  # (O, Bc*Pc)
            if bias is not None:
                y2 += bias[:, None]
            self._put(y, y2, chunk)
        # Beyond a kept small unfolding, backward unfolds x again (see the module).
        self.x, self.weight = x, weight
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        nx, nw, nb = self.needs_input_grad
        weight, g = self.weight, self.groups
        o = weight.shape[0]
        b, c = self.x_shape[:2]
        gb = gw = gx = gxpad = None
        if nb:
            gy3 = gy.reshape(b, o, math.prod(gy.shape[2:]))  # (B, O, P); not -1: B may be 0
            gb = xp.matmul(gy3, xp.ones(gy3.shape[2], dtype=gy.dtype)).sum(axis=0)  # (O,)
        if not (nx or nw):
            return None, None, gb
        # The kept unfolding is taken (backward writes over it): a second backward
        # (retain_graph) unfolds x again.
        kept, self.cols = self.cols, None
        xpad = self.unfold.pad(self.x) if nw and kept is None else None
        if nx:
            gxpad = self.unfold.zeros(gy.dtype, xp)
        single = len(self.chunks) == 1
        w3 = weight.reshape(g, o // g, -1)  # (g, Og, Cg*K)
        ck = w3.shape[2]
        positions = math.prod(self.out)
        for chunk in self.chunks:
            b0, b1, r0, r1 = chunk
            bc = b1 - b0
            n = bc * (r1 - r0) * math.prod(self.out[1:])
            # Per sample (large maps, see _PER_SAMPLE_BACKWARD_FROM) or over the chunk.
            per_sample = self._per_sample(xp, chunk, _PER_SAMPLE_BACKWARD_FROM)
            ps_weight = per_sample and ck < _GW_TRANSPOSED_FROM
            gy2 = gy3 = None
            if (nw and not ps_weight) or (nx and not per_sample):
                sel = (slice(b0, b1), slice(None), slice(r0, r1))
                # (O, Bc * Pc) contiguous, the GEMMs' layout
                gy2 = xp.ascontiguousarray(xp.swapaxes(gy[sel], 0, 1)).reshape(g, o // g, n)
            if per_sample:
                gy3 = gy[b0:b1].reshape(bc, o, positions)  # (Bc, O, P)
            cols = None
            if nw:
                cols = self.unfold.im2col(xpad, chunk) if kept is None else kept
                if ps_weight:
                    # sum_b gy[b] (O, P) @ cols[:, b]^T (P, C*K)
                    part = xp.matmul(gy3, xp.swapaxes(cols.reshape(ck, bc, positions), 0, 1)
                                     .transpose(0, 2, 1)).sum(axis=0).reshape(weight.shape)
                    buf = self.grad_buffer_for(1) if single else None
                    if buf is not None:
                        buf[...] = part
                        part = buf
                else:
                    part = self._weight_grad(gy2, cols.reshape(g, ck, n),
                                             self.grad_buffer_for(1) if single else None)
                if gw is None:
                    gw = part
                else:
                    gw += part
            if nx:
                # The input's unfolded gradient takes the place of cols, no longer needed.
                out = scratch(xp, (g, ck, n), gy.dtype) if cols is None else \
                    cols.reshape(g, ck, n)
                if per_sample:
                    # cols[:, b] (C*K, P) = W^T @ gy[b], written through a strided view
                    xp.matmul(w3[0].T, gy3, out=xp.swapaxes(out.reshape(ck, bc, positions),
                                                            0, 1))
                elif g == 1:
                    xp.matmul(w3[0].T, gy2[0], out=out[0])  # (C*K, N)
                else:
                    xp.matmul(xp.swapaxes(w3, 1, 2), gy2, out=out)  # (g, Cg*K, N)
                shape = (c,) + tuple(weight.shape[2:]) + (bc,) + self._chunk_out(chunk)
                self.unfold.col2im(gxpad, out.reshape(shape), chunk)
            del cols
        if nx:
            gx = self.unfold.unpad(gxpad)
        return gx, gw, gb

    def _per_sample(self, xp: Any, chunk: tuple, threshold: int) -> bool:
        """Whether to run this chunk's GEMMs one sample at a time: NumPy only (cuBLAS
        wants the one large GEMM), no groups, whole samples of ``threshold``+ positions."""
        return (xp is numpy and self.groups == 1 and chunk[3] - chunk[2] == self.out[0]
                and math.prod(self.out) >= threshold)

    def _weight_grad(self, gy2: Any, cols3: Any, buf: Any) -> Any:
        """``gy (g, Og, N) @ cols (g, Cg*K, N)^T`` as the weight's shape, into ``buf``
        (the data-parallel bucket slice) when given."""
        xp = get_array_module(gy2)
        g, og, ck = gy2.shape[0], gy2.shape[1], cols3.shape[1]
        shape = self.weight.shape
        if g == 1 and ck >= _GW_TRANSPOSED_FROM:
            part = xp.matmul(cols3[0], gy2[0].T).T  # (O, C*K), a view of (C*K, O)
            if buf is None:
                return xp.ascontiguousarray(part).reshape(shape)
            buf.reshape(og, ck)[...] = part
            return buf
        if g == 1:
            part = xp.matmul(gy2[0], cols3[0].T, out=None if buf is None else
                             buf.reshape(og, ck))  # (O, C*K)
        else:
            part = xp.matmul(gy2, xp.swapaxes(cols3, 1, 2), out=None if buf is None else
                             buf.reshape(g, og, ck))  # (g, Og, Cg*K)
        return part.reshape(shape) if buf is None else buf

    # -- pieces ------------------------------------------------------------------------
    def _chunk_out(self, chunk: tuple[int, int, int, int]) -> tuple[int, ...]:
        return (chunk[3] - chunk[2],) + self.out[1:]

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
    keep = is_grad_enabled() and isinstance(weight, Tensor) and weight.requires_grad
    return Convolution.apply(x, weight, bias, stride=stride, pads=pads, dilation=dilation,
                             groups=groups, keep_cols=keep)


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
