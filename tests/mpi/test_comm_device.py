"""Device buffers in every collective: the path of mpidl.comm.device, at any size.

CuPy is stood in for by mpidl.testing.fakedevice: host memory that mpidl takes for
device arrays, readable by MPI through ``__cuda_array_interface__``. Each test checks
the numbers and what a GPU would have seen (MPI handed a device pointer, copies
through pinned memory, host waits) against the table.
"""
from __future__ import annotations

import contextlib

import numpy
import pytest

from mpidl.comm import split_counts
from mpidl.comm.device import DIRECT, OPEN_MPI, OTHER, device_path
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks
from mpidl.testing.fakedevice import fake_cupy

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


@contextlib.contextmanager
def device_comm(comm, aware, library=OPEN_MPI):
    """A communicator over ``comm``'s ranks with the verdict and library forced."""
    if comm.mpi_comm is None:
        pytest.skip("needs MPI (a size-1 world without a launcher has no MpiCommunicator)")
    from mpidl.comm.mpi import MpiCommunicator

    with fake_cupy() as cp:
        c = MpiCommunicator(comm.mpi_comm, cuda_aware=aware)
        c.stager.library = library
        try:
            yield c, cp
        finally:
            c.free()


def ranked(shape, rank, dtype="float64"):
    n = int(numpy.prod(shape))
    return (numpy.arange(n) + 10 * rank).reshape(shape).astype(dtype)


def _allreduce(c, cp):
    x = cp.asarray(ranked((5,), c.rank))
    c.allreduce_(x)
    return "allreduce_", x, sum(ranked((5,), r) for r in range(c.size))


def _reduce(c, cp):
    x = cp.asarray(ranked((4,), c.rank))
    c.reduce_(x, root=0)
    total = sum(ranked((4,), r) for r in range(c.size))
    return "reduce_", x, total if c.rank == 0 else ranked((4,), c.rank)


def _iallreduce(c, cp):
    x = cp.asarray(ranked((6,), c.rank))
    c.iallreduce_(x).wait()
    return "iallreduce_", x, sum(ranked((6,), r) for r in range(c.size))


def _reduce_scatter(rows_per_rank, extra):
    def run(c, cp):
        shape = (rows_per_rank * c.size + extra, 2)
        out = c.reduce_scatter(cp.asarray(ranked(shape, c.rank)))
        rows = split_counts(shape[0], c.size)
        total = sum(ranked(shape, r) for r in range(c.size))
        start = sum(rows[:c.rank])
        name = "reduce_scatter_block" if len(set(rows)) == 1 else "reduce_scatter"
        return name, out, total[start:start + rows[c.rank]]
    return run


def _bcast(c, cp):
    x = cp.asarray(ranked((3,), c.rank))
    c.bcast_(x, root=c.size - 1)
    return "bcast_", x, ranked((3,), c.size - 1)


def _allgather(c, cp):
    out = c.allgather(cp.asarray(ranked((2,), c.rank)))
    return "allgather", out, numpy.stack([ranked((2,), r) for r in range(c.size)])


def _allgatherv(c, cp):
    out = c.allgatherv(cp.asarray(ranked((c.rank + 1, 2), c.rank)))
    return "allgatherv", out, numpy.concatenate([ranked((r + 1, 2), r) for r in range(c.size)])


def _alltoall(c, cp):
    out = c.alltoall(cp.asarray(ranked((c.size, 2), c.rank)))
    expected = numpy.stack([ranked((c.size, 2), r)[c.rank] for r in range(c.size)])
    return "alltoall", out, expected


def _sendrecv(c, cp):
    out = c.sendrecv(cp.asarray(ranked((3,), c.rank)), dest=(c.rank + 1) % c.size,
                     source=(c.rank - 1) % c.size)
    return "sendrecv", out, ranked((3,), (c.rank - 1) % c.size)


COLLECTIVES = {
    "allreduce_": _allreduce, "reduce_": _reduce, "iallreduce_": _iallreduce,
    "reduce_scatter_equal": _reduce_scatter(2, 0), "reduce_scatter_uneven": _reduce_scatter(1, 1),
    "bcast_": _bcast, "allgather": _allgather, "allgatherv": _allgatherv,
    "alltoall": _alltoall, "sendrecv": _sendrecv,
}


@pytest.mark.parametrize("library", [OPEN_MPI, OTHER])
@pytest.mark.parametrize("aware", [True, False])
@pytest.mark.parametrize("case", list(COLLECTIVES))
def test_each_collective_takes_the_tables_path_for_a_device_buffer(comm, case, aware, library):
    with device_comm(comm, aware, library) as (c, cp):
        name, out, expected = COLLECTIVES[case](c, cp)
        path = device_path(name, library, aware, "sum")
        direct, staged = cp.mpi_reads() > 0, ("to_host", out.nbytes) in cp.copies() or \
            ("to_device", out.nbytes) in cp.copies()
        assert_all_ranks(comm, type(out).__module__.startswith("cupy"), f"{case}: not on device")
        assert_allclose_all_ranks(comm, out, expected, what=case)
        assert_all_ranks(comm, (direct, staged) == (path == DIRECT, path != DIRECT),
                         f"{name} ({library}, aware={aware}) should go {path}: MPI read device "
                         f"pointers {cp.mpi_reads()} times, copies {cp.copies()}")


def test_iallreduce_never_hands_mpi_a_device_pointer_even_when_mpi_is_cuda_aware(comm):
    # The overlapped gradient buckets across nodes: Open MPI's libnbc would reduce
    # through the device pointer on the host (ompi#9845, #12045).
    with device_comm(comm, aware=True) as (c, cp):
        x = cp.asarray(ranked((8,), c.rank, "float32"))
        c.iallreduce_(x).wait()
        expected = sum(ranked((8,), r, "float32") for r in range(c.size))
        assert_allclose_all_ranks(comm, x, expected, what="iallreduce_")
        assert_all_ranks(comm, cp.mpi_reads() == 0, f"MPI read a device pointer: {cp.log}")
        assert_all_ranks(comm, cp.copies() == [("to_host", 32), ("to_device", 32)], cp.log)


def test_staged_iallreduce_neither_blocks_the_host_nor_starts_out_of_order(comm):
    with device_comm(comm, aware=True) as (c, cp):
        cp.hold_events = True  # the copies to the host are "still running"
        a, b = cp.asarray(ranked((4,), c.rank)), cp.asarray(ranked((3,), c.rank))
        first, second = c.iallreduce_(a), c.iallreduce_(b)
        waiting = (not first.started, not second.started, not second.test(), cp.host_waits())
        assert_all_ranks(comm, waiting == (True, True, True, 0),
                         f"(first, second not started, test False, host waits) = {waiting}")
        cp.release_events()
        second.test()  # the first one starts before it, on every rank
        assert_all_ranks(comm, first.started and second.started, "not started after release")
        first.wait()
        second.wait()
        assert_allclose_all_ranks(comm, a, sum(ranked((4,), r) for r in range(c.size)))
        assert_allclose_all_ranks(comm, b, sum(ranked((3,), r) for r in range(c.size)))
        assert_all_ranks(comm, cp.host_waits() == 0, f"the host waited: {cp.log}")


def test_a_blocking_collective_starts_the_waiting_non_blocking_ones_first(comm):
    with device_comm(comm, aware=True) as (c, cp):
        cp.hold_events = True
        a = cp.asarray(ranked((4,), c.rank))
        pending = c.iallreduce_(a)
        flag = c.allreduce_(numpy.array([c.rank], dtype=numpy.int64))  # a host collective
        assert_all_ranks(comm, pending.started, "the blocking collective overtook iallreduce_")
        pending.wait()
        assert_allclose_all_ranks(comm, a, sum(ranked((4,), r) for r in range(c.size)))
        assert_allclose_all_ranks(comm, flag, numpy.array([sum(range(c.size))]))


@contextlib.contextmanager
def without_an_mpi_float16_type():
    """What mpi4py has on an MPI without MPIX_C_FLOAT16 (many MPICH builds)."""
    from mpi4py import MPI

    saved = MPI._typedict.pop("e", None)
    try:
        yield
    finally:
        if saved is not None:
            MPI._typedict["e"] = saved


def test_float16_travels_without_an_mpi_float16_datatype(comm):
    def f16(shape, rank):
        return (ranked(shape, rank) / 4).astype(numpy.float16)

    with without_an_mpi_float16_type():
        x = f16((5,), comm.rank)
        comm.allreduce_(x)
        y = f16((3,), comm.rank)
        comm.iallreduce_(y).wait()
        z = f16((2,), comm.rank)
        comm.bcast_(z, root=0)
        gathered = comm.allgather(f16((2,), comm.rank))
        gathered_v = comm.allgatherv(f16((comm.rank + 1,), comm.rank))
        shifted = comm.sendrecv(f16((3,), comm.rank), dest=(comm.rank + 1) % comm.size,
                                source=(comm.rank - 1) % comm.size)
        scattered = comm.reduce_scatter(f16((2 * comm.size,), comm.rank))
    total = sum(f16((5,), r) for r in range(comm.size))
    assert_allclose_all_ranks(comm, x, total, what="allreduce_")
    assert_allclose_all_ranks(comm, y, sum(f16((3,), r) for r in range(comm.size)), what="iall")
    assert_allclose_all_ranks(comm, z, f16((2,), 0), what="bcast_")
    assert_allclose_all_ranks(comm, gathered, numpy.stack([f16((2,), r) for r in range(comm.size)]))
    assert_allclose_all_ranks(comm, gathered_v,
                              numpy.concatenate([f16((r + 1,), r) for r in range(comm.size)]))
    assert_allclose_all_ranks(comm, shifted, f16((3,), (comm.rank - 1) % comm.size))
    full = sum(f16((2 * comm.size,), r) for r in range(comm.size))
    assert_allclose_all_ranks(comm, scattered, full[2 * comm.rank:2 * comm.rank + 2])
    kinds = {a.dtype for a in (x, y, z, gathered, gathered_v, shifted, scattered)}
    assert_all_ranks(comm, kinds == {numpy.dtype(numpy.float16)}, f"dtypes {kinds}")


def test_a_float16_device_sum_is_staged_for_its_host_side_op(comm):
    with device_comm(comm, aware=True) as (c, cp), without_an_mpi_float16_type():
        x = cp.asarray((ranked((4,), c.rank) / 8).astype(numpy.float16))
        c.allreduce_(x)
        expected = sum((ranked((4,), r) / 8).astype(numpy.float16) for r in range(c.size))
        assert_allclose_all_ranks(comm, x, expected, what="float16 allreduce_")
        assert_all_ranks(comm, cp.mpi_reads() == 0 and ("to_host", 8) in cp.copies(), cp.log)


def test_float16_gradient_buckets_average_without_an_mpi_float16_datatype(comm):
    from mpidl.nn.linear import Linear
    from mpidl.parallel import DataParallel

    with without_an_mpi_float16_type():
        model = Linear(4, 3, seed=0, dtype="float16")
        dp = DataParallel(model, comm, overlap=True)  # broadcast, then non-blocking buckets
        try:
            x = numpy.full((2, 4), comm.rank + 1.0, dtype=numpy.float16)
            from mpidl import functions as F

            dp.backward(F.sum(dp(x)), global_count=2 * comm.size)
            grad = model.weight.grad.copy()
        finally:
            dp.close()
    # d/dW of sum(x W^T + b) is each input row summed: mean over ranks of 2 (rank + 1).
    mean_input = sum(2 * (r + 1.0) for r in range(comm.size)) / (2 * comm.size)
    assert_allclose_all_ranks(comm, grad, numpy.full((3, 4), mean_input, numpy.float16),
                              what="float16 bucket")
