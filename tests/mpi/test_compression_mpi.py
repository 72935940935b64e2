"""16-bit gradients across real ranks: a NaN or an infinity that one rank sends arrives
on every rank, whatever its bit pattern, through compression, the custom MPI sum and
decompression; finite values sum to the float32 sum up to the wire dtype's tolerance.
Run at 1, 2 and 3 ranks::

    mpiexec -n 3 python -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_compression_mpi.py
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.parallel.compression import WIRE_DTYPES, compress, decompress, wire_sum_op
from mpidl.testing import assert_allclose_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

# Signalling and quiet NaNs of both signs, among them those that bfloat16 rounding used
# to turn into inf (0x7F800001), -0.0 (0x7FFFFFFF) or 0.0 (0xFFFF8000, 0xFFFFFFFF).
NANS = [0x7F800001, 0x7FA00000, 0x7FBFFFFF, 0x7FC00000, 0x7FFF8000, 0x7FFFFFFF,
        0xFF800001, 0xFFC00000, 0xFFFF7FFF, 0xFFFF8000, 0xFFFFFFFF]


@pytest.mark.parametrize("wire_dtype", WIRE_DTYPES)
def test_a_nan_or_infinity_from_the_last_rank_arrives_on_every_rank(comm, wire_dtype):
    k, finite = len(NANS), 5
    flat = numpy.full(k + 2 + finite, comm.rank + 1.0, dtype=numpy.float32)
    if comm.rank == comm.size - 1:
        flat[:k].view(numpy.uint32)[:] = NANS
        flat[k:k + 2] = numpy.inf, -numpy.inf
    wire = compress(flat, wire_dtype)
    if comm.size > 1:  # one rank has no MPI op to run: the round trip alone
        comm.allreduce_(wire, op=wire_sum_op(wire_dtype))
    decompress(wire, wire_dtype, flat)
    expected = numpy.full(flat.size, sum(r + 1.0 for r in range(comm.size)), numpy.float32)
    expected[:k], expected[k:k + 2] = numpy.nan, (numpy.inf, -numpy.inf)
    assert_allclose_all_ranks(comm, flat, expected, dtype=wire_dtype, what=wire_dtype)
