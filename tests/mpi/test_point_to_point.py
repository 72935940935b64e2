"""Point-to-point isend/irecv_/send/recv_ on real ranks, at any size.

Expected values are functions of rank and size; each test ends in a collective verdict.
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.comm import DistributedError
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def test_a_ring_of_isend_and_irecv_matches_by_tag_and_order(comm, xp):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = [xp.empty((2, 3), dtype="float32") for _ in range(3)]
    reqs = [comm.irecv_(got[k], left, tag=t) for k, t in ((2, 7), (0, 4), (1, 4))]
    reqs += [comm.isend(xp.full((2, 3), 100 * comm.rank + k, dtype="float32"), right, tag=t)
             for k, t in ((0, 4), (1, 4), (2, 7))]
    for r in reqs:
        r.wait()
    want = numpy.stack([numpy.full((2, 3), 100 * left + k, dtype="float32") for k in range(3)])
    assert_allclose_all_ranks(comm, xp.stack(got), want, what="ring")


def test_blocking_send_and_recv_in_parity_order_pass_a_value_down_a_line(comm):
    # Rank r receives from r - 1 then sends to r + 1: a line never waits on itself.
    x = numpy.zeros(5)
    if comm.rank > 0:
        comm.recv_(x, comm.rank - 1, tag=1)
    x += 1
    if comm.rank < comm.size - 1:
        comm.send(x, comm.rank + 1, tag=1)
    assert_allclose_all_ranks(comm, x, numpy.full(5, comm.rank + 1.0), what="line")


def test_a_message_of_another_size_is_an_error_naming_both_ranks(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    error = ""
    if comm.rank == 0:
        comm.send(numpy.zeros(3), 1, tag=2)
    elif comm.rank == 1:
        try:
            comm.recv_(numpy.empty(4), 0, tag=2)
        except DistributedError as e:
            error = str(e)
    # Under MPIDL_CHECK_COLLECTIVES=1 the sender's description names it first.
    sent = "shape (3,), float64 (sent at" if comm.check_collectives else "24 bytes,"
    ok = comm.rank != 1 or (f"rank 0 (world 0) sent {sent}" in error and
                            "rank 1 (world 1) receives shape (4,), float64 (32 bytes)" in error)
    assert_all_ranks(comm, ok, error)


def test_check_mode_names_a_shape_or_dtype_mismatch_with_the_senders_call_site(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    sub = comm.split(0)
    sub.check_collectives = True  # what MPIDL_CHECK_COLLECTIVES=1 sets
    error = ""
    if sub.rank == 0:
        sub.send(numpy.zeros((2, 3), dtype="float32"), 1)
    elif sub.rank == 1:
        try:
            sub.recv_(numpy.empty((3, 2), dtype="int32"), 0)
        except DistributedError as e:
            error = str(e)
    ok = sub.rank != 1 or ("rank 0 (world 0) sent shape (2, 3), float32 (sent at "
                           "test_point_to_point.py:" in error and "receives shape (3, 2), int32"
                           in error)
    sub.barrier()  # point-to-point calls left the collectives' numbers alike
    assert_all_ranks(comm, ok, error)
    sub.free()
