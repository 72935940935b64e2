"""Device buffers in the non-blocking point-to-point calls and iallgather, at any size
(#48 point 4: tests/mpi/test_comm_device.py's table has none of them).

CuPy is stood in for by mpidl.testing.fakedevice, as there: each test checks the numbers
and what a GPU would have seen (MPI handed a device pointer, copies through pinned
memory, pinned allocations). The pipeline sends its activations with these calls.
"""
from __future__ import annotations

import contextlib

import numpy
import pytest

from mpidl.comm.device import OPEN_MPI
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks, raises_all_ranks
from mpidl.testing.fakedevice import FakeDeviceArray, fake_cupy

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@contextlib.contextmanager
def device_comm(comm, aware):
    """A communicator over ``comm``'s ranks with the CUDA-aware verdict forced (None:
    undecided, as a job starts)."""
    if comm.mpi_comm is None:
        pytest.skip("needs MPI (a size-1 world without a launcher has no MpiCommunicator)")
    from mpidl.comm.mpi import MpiCommunicator

    with fake_cupy() as cp:
        c = MpiCommunicator(comm.mpi_comm, cuda_aware=aware)
        c.stager.library = OPEN_MPI
        try:
            yield c, cp
        finally:
            c.free()


def ranked(n, rank, dtype="float64"):
    return (numpy.arange(n) + 10 * rank).astype(dtype)


@pytest.mark.parametrize("aware", [True, False])
def test_isend_and_irecv_move_device_arrays_around_a_ring(comm, aware):
    with device_comm(comm, aware) as (c, cp):
        right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
        x = cp.asarray(ranked(7, c.rank))
        got = cp.zeros(7)
        receive = c.irecv_(got, left, tag=3)
        send = c.isend(x, right, tag=3)
        send.wait()
        receive.wait()
        assert_all_ranks(comm, isinstance(got, FakeDeviceArray), "received off the device")
        assert_allclose_all_ranks(comm, got.get(), ranked(7, left), what="irecv_")
        staged = ("to_host", 56) in cp.copies() and ("to_device", 56) in cp.copies()
        assert_all_ranks(comm, staged == (not aware) or c.size == 1,
                         f"aware={aware}: copies {cp.copies()}")


@pytest.mark.parametrize("aware", [True, False])
def test_isendrecv_and_iallgather_of_device_arrays(comm, aware):
    with device_comm(comm, aware) as (c, cp):
        right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
        out = c.isendrecv(cp.asarray(ranked(5, c.rank)), right, left).wait()
        assert_allclose_all_ranks(comm, out.get(), ranked(5, left), what="isendrecv")
        gathered = c.iallgather(cp.asarray(ranked(3, c.rank))).wait()
        want = numpy.stack([ranked(3, r) for r in range(c.size)])
        assert_allclose_all_ranks(comm, gathered.get().reshape(want.shape), want,
                                  what="iallgather")


def test_point_to_point_needs_prepare_device_first_and_then_works(comm):
    # The decision is a collective probe; a send made by two ranks cannot run it.
    with device_comm(comm, None) as (c, cp):
        x = cp.asarray(ranked(4, c.rank))
        with raises_all_ranks(comm, RuntimeError, match="prepare_device"):
            c.isend(x, (c.rank + 1) % c.size)
        c.stager.cuda_aware = False  # what prepare_device's probe decides without CuPy
        c.prepare_device()
        got = cp.zeros(4)
        receive = c.irecv_(got, (c.rank - 1) % c.size)
        c.isend(x, (c.rank + 1) % c.size).wait()
        receive.wait()
        assert_allclose_all_ranks(comm, got.get(), ranked(4, (c.rank - 1) % c.size),
                                  what="after prepare_device")


def test_uneven_staged_messages_reuse_one_pinned_buffer(comm):
    # The pool was keyed by exact byte size: a pipeline's uneven microbatches allocated
    # a pinned buffer for each size. Now one power-of-two class serves them.
    with device_comm(comm, False) as (c, cp):
        for n in (100, 97, 90, 128, 65):
            c.allreduce_(cp.asarray(numpy.ones(n)))
        pinned = [entry for entry in cp.trace if entry[0] == "pinned"]
        assert_all_ranks(comm, len(pinned) <= 1 or c.size == 1,
                         f"pinned allocations {pinned}")
