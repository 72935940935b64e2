"""Gradients on the wire in 16 bits: float16 or bfloat16, summed by a custom MPI op.

Halving the bytes halves the allreduce time where bandwidth is the limit (ChainerMN's
``allreduce_grad_dtype=float16``, Horovod's ``Compression.fp16``). MPI has no standard
16-bit float type, so the wire buffer is sent as raw 16-bit integers and a
user-defined, commutative MPI op adds them as floats: float16 through NumPy's half
type, bfloat16 (the upper half of a float32, same range as float32, so no overflow or
underflow worries) by widening to float32, adding, and rounding back to nearest-even.

The reduction runs on the host (MPI calls user ops on host memory), so CuPy gradients
are compressed on the device and the communicator stages the 16-bit buffer through
pinned host memory (:mod:`mpidl.comm.device`); the float16 sum is the communicators' own
(:mod:`mpidl.comm.datatypes`), which every float16 reduction uses.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.backend import get_array_module, to_device
from mpidl.comm.datatypes import IEEE_RESULTS, float16_sum_op

WIRE_DTYPES = ("float16", "bfloat16")

_ops: dict[str, Any] = {}


# Host arrays are converted in blocks of this many elements, through scratch arrays
# made once per call, so each step of the conversion is a NumPy pass in cache. With a
# fresh full-size temporary per step instead, the page faults of 32 MB temporaries cost
# more than the arithmetic (8M elements, 2-core CI machine, NumPy 2.4: compress 31 ms
# whole, 7.5 ms in blocks of 256K; the wire sum 59 ms and 13 ms). On a GPU a block is
# the whole array: there each step is a kernel launch.
HOST_BLOCK = 1 << 18


def _blocks(n: int, xp: Any) -> list[slice]:
    """The slices of ``range(n)`` that are converted one at a time."""
    step = HOST_BLOCK if xp is numpy else max(n, 1)
    return [slice(i, i + step) for i in range(0, n, step)]


def _round_to_bfloat16(x: Any, out: Any, scratch: tuple) -> None:
    """``out[...] =`` float32 ``x`` rounded to bfloat16 bit patterns (1-D, same size).

    ``scratch``: uint32, uint32 and bool arrays at least as long as ``x``.
    """
    xp = get_array_module(x)
    r, quiet, nan = (a[:x.size] for a in scratch)
    bits = x.view(xp.uint32)
    xp.right_shift(bits, 16, out=r)
    r &= 1
    r += 0x7FFF  # round half to even: 0x7FFF, or 0x8000 when the kept half is odd
    r += bits
    # A NaN must not be rounded: the add carries its payload into the exponent (a NaN
    # became inf or, past the sign bit, -0.0) or wraps past 2**32 (negative NaN -> 0.0),
    # and a NaN gradient vanished on the wire. Its upper half with the quiet bit set is
    # a NaN of the same sign (what hardware conversions such as AVX512-BF16 return).
    xp.isnan(x, out=nan)
    xp.bitwise_or(bits, 0x00400000, out=quiet)
    xp.copyto(r, quiet, where=nan)
    r >>= 16
    xp.copyto(out, r, casting="unsafe")


def float32_to_bfloat16(x: Any, out: Any = None) -> Any:
    """Round float32 values to bfloat16 bit patterns (uint16), to nearest even.

    Infinities stay infinite and every NaN stays a NaN of the same sign (quieted); a
    finite value too large for bfloat16 rounds to an infinity, as in IEEE arithmetic.

    Args:
        x: values, converted to float32 first.
        out: a contiguous uint16 array of ``x``'s size on the same device to write
            into; a new one of ``x``'s shape when None.
    """
    xp = get_array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    if out is None:
        out = xp.empty(x.shape, dtype=xp.uint16)
    elif out.size != x.size or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous array of {x.size} elements, "
                         f"not shape {out.shape} (contiguous: {out.flags.c_contiguous})")
    src, dst = x.reshape(-1), out.reshape(-1)  # views: dst writes into out
    parts = _blocks(src.size, xp)
    n = min(src.size, parts[0].stop) if parts else 0  # the longest block
    scratch = (xp.empty(n, xp.uint32), xp.empty(n, xp.uint32), xp.empty(n, bool))
    for part in parts:
        _round_to_bfloat16(src[part], dst[part], scratch)
    return out


def bfloat16_to_float32(b: Any) -> Any:
    """Widen bfloat16 bit patterns (uint16) to float32 values (exact)."""
    xp = get_array_module(b)
    return (b.astype(xp.uint32) << 16).view(xp.float32)


def _sum_bfloat16(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    a = numpy.frombuffer(inbuf, dtype=numpy.uint16)
    b = numpy.frombuffer(inoutbuf, dtype=numpy.uint16)
    with numpy.errstate(**IEEE_RESULTS):
        for part in _blocks(b.size, numpy):  # MPI hands over whole buffers: in blocks
            total = bfloat16_to_float32(a[part])
            total += bfloat16_to_float32(b[part])
            float32_to_bfloat16(total, out=b[part])


def wire_sum_op(wire_dtype: str) -> Any:
    """The MPI op that sums 16-bit wire buffers of ``wire_dtype`` (created once)."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"compression={wire_dtype!r}: use one of {WIRE_DTYPES} or None")
    if wire_dtype == "float16":
        return float16_sum_op()  # the communicators' own float16 sum
    if wire_dtype not in _ops:
        # here: `import mpidl.parallel` loads no mpi4py (a single process needs none)
        from mpi4py import MPI

        _ops[wire_dtype] = MPI.Op.Create(_sum_bfloat16, commute=True)
    return _ops[wire_dtype]


def compress(flat: Any, wire_dtype: str, out: Any = None) -> Any:
    """The 16-bit wire form of a gradient bucket: a uint16 array on ``flat``'s device.

    A device wire buffer stays on the device: the communicator stages it through pinned
    host memory for the user-defined sum (:mod:`mpidl.comm.device`), without a host
    synchronisation in the middle of backward for a non-blocking allreduce.
    """
    xp = get_array_module(flat)
    if wire_dtype == "bfloat16":
        return float32_to_bfloat16(flat, out=out)  # straight into the wire buffer
    if out is None:
        return flat.astype(xp.float16).view(xp.uint16)
    halves = out.reshape(-1).view(xp.float16)  # a view: writes into out
    xp.copyto(halves, flat.reshape(-1), casting="same_kind")
    return out


def decompress(wire: Any, wire_dtype: str, flat: Any) -> None:
    """Write the summed wire buffer back into the bucket (in place, on its device)."""
    if wire_dtype == "float16":
        values = wire.view(numpy.float16)
    else:
        values = bfloat16_to_float32(wire)
    flat[...] = to_device(values, get_array_module(flat)).astype(flat.dtype, copy=False)
