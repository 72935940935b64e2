"""16-bit floats through MPI: float16 arrays travel as their uint16 bit patterns.

MPI has no standard 16-bit float type. mpi4py maps NumPy's float16 (format ``"e"``) only
where the library defines ``MPIX_C_FLOAT16`` or ``MPIX_SHORT_FLOAT`` (mpi4py
``typemap.pxi``, mpi4py#626): Open MPI 5 built by a compiler with ``_Float16`` has one,
many MPICH and older Open MPI builds have not, and there a float16 gradient bucket or
parameter broadcast fails inside mpi4py, on those machines only. So every communicator
hands float16 to MPI the same way, whatever the library: data movement (broadcast,
gathers, sendrecv) as uint16, which is bit-exact, and sums as uint16 with a
user-defined op that adds the values as float16 (NumPy's half arithmetic, the same
pairwise adds a native float16 sum makes). Max, min and product of float16 raise
TypeError: reduce a float32 copy.

A user-defined op runs on host memory, so a float16 device buffer is staged for a sum
(:mod:`mpidl.comm.device`).

bfloat16 (``ml_dtypes``) has no MPI type before MPICH's ``MPIX_BFLOAT16`` and none in
Open MPI: it moves as uint16 like float16, bit-exact, and is not reduced at all (a
bfloat16 sum rounds every add to 8 bits). Mixed precision reduces gradients in
float32 (:mod:`mpidl.parallel.buckets`); reduce ``x.astype(numpy.float32)``.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.comm.base import check_reducible

# The sums run with these floating-point warnings off: inf + -inf is NaN and a sum past
# the largest value is inf, the IEEE results the wire means to carry (to the
# non-finite gradient policy), not a warning from every rank at every reduction.
IEEE_RESULTS = {"over": "ignore", "invalid": "ignore"}

_float16_sum: Any = None


def _sum_float16(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
    a = numpy.frombuffer(inbuf, dtype=numpy.float16)
    b = numpy.frombuffer(inoutbuf, dtype=numpy.float16)
    with numpy.errstate(**IEEE_RESULTS):
        numpy.add(b, a, out=b)


def float16_sum_op() -> Any:
    """The MPI op that sums uint16 buffers holding float16 values (created once)."""
    global _float16_sum
    if _float16_sum is None:
        from mpi4py import MPI

        _float16_sum = MPI.Op.Create(_sum_float16, commute=True)
    return _float16_sum


def is_float16(x: Any) -> bool:
    return x.dtype == numpy.float16


def is_bfloat16(x: Any) -> bool:
    return x.dtype.name == "bfloat16"


def bits(x: Any) -> Any:
    """What MPI moves for ``x``: its uint16 view when a 16-bit float, else ``x``."""
    return x.view(numpy.uint16) if is_float16(x) or is_bfloat16(x) else x


def reducible(x: Any, op: Any, what: str) -> tuple[Any, Any]:
    """The buffer and op MPI reduces for ``x`` reduced by ``op`` (a name or ``MPI.Op``).

    Float16 with "sum" becomes its uint16 view and :func:`float16_sum_op`; float16 with a
    user-defined op its uint16 view (the op reads the bytes); any other float16 op is a
    TypeError (:func:`~mpidl.comm.base.check_reducible`); bfloat16 is a TypeError with
    any named op. Other dtypes pass through.
    """
    if is_bfloat16(x) and isinstance(op, str):
        raise TypeError(f"{what} of a bfloat16 array: MPI has no bfloat16 type, and a "
                        "bfloat16 sum rounds every add to 8 bits; reduce "
                        "x.astype(numpy.float32)")
    if is_bfloat16(x):
        return bits(x), op
    if not is_float16(x):
        return x, op
    if not isinstance(op, str):
        return bits(x), op
    check_reducible(x, what, op)
    return bits(x), float16_sum_op()


__all__ = ["IEEE_RESULTS", "float16_sum_op", "bits", "reducible"]
