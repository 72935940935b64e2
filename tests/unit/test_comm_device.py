"""The device-buffer path table (mpidl.comm.device) and float16 on the wire (datatypes).

What each collective does with a device buffer is checked on real ranks with fake
device arrays in tests/mpi/test_comm_device.py; here the table itself.
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.comm import datatypes
from mpidl.comm.device import DIRECT, OPEN_MPI, OTHER, PATHS, STAGED, device_path, library_family


def test_library_family_reads_the_version_string():
    assert library_family("Open MPI v5.0.11, package: Open MPI ...") == OPEN_MPI
    assert library_family("MPICH Version: 4.2.0") == OTHER
    assert library_family("MVAPICH2 Version 2.3.7") == OTHER
    assert library_family("Intel(R) MPI Library 2021.12") == OTHER


@pytest.mark.parametrize("library", [OPEN_MPI, OTHER, "some future MPI"])
def test_non_blocking_reductions_are_staged_whatever_the_verdict(library):
    # open-mpi/ompi#9845, #12045: libnbc reduces through the device pointer and segfaults.
    for aware in (True, False):
        assert device_path("iallreduce_", library, aware, "sum") == STAGED


def test_open_mpi_reduce_scatter_goes_direct_only_with_equal_blocks():
    # coll/cuda wraps Reduce_scatter_block, and Reduce_scatter only after 5.0.x.
    assert device_path("reduce_scatter_block", OPEN_MPI, True, "sum") == DIRECT
    assert device_path("reduce_scatter", OPEN_MPI, True, "sum") == STAGED


def test_other_libraries_go_direct_only_where_the_probe_looked():
    direct = {c for c in PATHS if device_path(c, OTHER, True, "sum") == DIRECT}
    assert direct == {"allreduce_", "bcast_", "allgather", "allgatherv", "alltoall", "sendrecv"}


def test_a_non_aware_mpi_stages_everything():
    for collective in PATHS:
        for library in (OPEN_MPI, OTHER):
            assert device_path(collective, library, False) == STAGED


class Op:
    """An mpi4py ``MPI.Op`` as the table sees it (no MPI initialised in unit tests)."""

    def __init__(self, is_predefined):
        self.is_predefined = is_predefined


def test_user_defined_ops_are_staged_because_mpi_runs_them_on_the_host():
    assert device_path("allreduce_", OPEN_MPI, True, Op(False)) == STAGED  # MPI.Op.Create
    assert device_path("allreduce_", OPEN_MPI, True, Op(True)) == DIRECT  # MPI.SUM
    assert device_path("allreduce_", OPEN_MPI, True, "max") == DIRECT


def test_an_unknown_collective_is_a_bug_not_a_default():
    with pytest.raises(KeyError):
        device_path("scan", OPEN_MPI, True)


def test_float16_is_reduced_as_uint16_with_the_float16_sum(monkeypatch):
    monkeypatch.setattr(datatypes, "_float16_sum", sentinel := Op(False))
    x = numpy.ones(3, dtype=numpy.float16)
    wire, op = datatypes.reducible(x, "sum", "allreduce_")
    assert wire.dtype == numpy.uint16 and numpy.shares_memory(wire, x)
    assert op is sentinel
    assert datatypes.bits(x).dtype == numpy.uint16
    y = numpy.ones(3, dtype=numpy.float32)
    assert datatypes.reducible(y, "max", "allreduce_") == (y, "max")
    assert datatypes.bits(y) is y


def test_float16_max_is_refused_with_the_fix_named_by_every_communicator():
    from mpidl.comm import SingleCommunicator

    with pytest.raises(TypeError, match=r"float16 array with op='max'.*astype\(numpy.float32\)"):
        datatypes.reducible(numpy.ones(2, numpy.float16), "max", "allreduce_")
    with pytest.raises(TypeError, match="float16 array with op='min'"):
        SingleCommunicator().allreduce_(numpy.ones(2, numpy.float16), op="min")
    with pytest.raises(ValueError, match="unknown reduction op 'avg'"):
        datatypes.reducible(numpy.ones(2, numpy.float16), "avg", "allreduce_")


def test_a_bfloat16_reduction_is_refused_by_every_communicator_with_the_fix():
    # MPI has no bfloat16 type: one process and thread ranks refuse it as MPI would, so a
    # script tried on one rank does not fail first on two.
    from ml_dtypes import bfloat16

    from mpidl.comm import SingleCommunicator

    with pytest.raises(TypeError, match=r"bfloat16 array.*astype\(numpy.float32\)"):
        SingleCommunicator().allreduce(numpy.ones(2, bfloat16))
    with pytest.raises(TypeError, match="bfloat16 array"):
        SingleCommunicator().allreduce_(numpy.ones(2, bfloat16), op="max")


def test_the_float16_sum_adds_as_float16_and_keeps_ieee_results():
    a = numpy.array([1.5, 65504.0, numpy.inf, 1e-4], dtype=numpy.float16)
    b = numpy.array([2.25, 65504.0, -numpy.inf, 1e-4], dtype=numpy.float16)
    out = b.copy()
    datatypes._sum_float16(a.view(numpy.uint16), out.view(numpy.uint16), None)
    with numpy.errstate(over="ignore", invalid="ignore"):
        expected = a + b
    numpy.testing.assert_array_equal(out, expected)  # inf, nan included
