"""Point-to-point send/recv on the thread, single and (report only) MPI communicators."""
from __future__ import annotations

import numpy
import pytest

from mpidl.comm import DistributedError, SingleCommunicator
from mpidl.comm import ledger as L
from mpidl.comm import watchdog as W
from mpidl.testing import run_ranks


def _ring(comm):
    # Every rank posts its receive and its send together, then waits: no order deadlocks.
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = [numpy.empty(3) for _ in range(2)]
    reqs = [comm.irecv_(got[k], left, tag=k) for k in (1, 0)]  # tags match, not order
    reqs += [comm.isend(numpy.full(3, 10.0 * comm.rank + k), right, tag=k) for k in (0, 1)]
    for r in reqs:
        r.wait()
    return [g[0] for g in got]


def test_isend_and_irecv_match_by_tag_around_a_ring_of_thread_ranks():
    assert run_ranks(3, _ring) == [[20.0, 21.0], [0.0, 1.0], [10.0, 11.0]]


def test_messages_of_one_tag_arrive_in_the_order_they_were_sent():
    def fn(comm):
        if comm.rank == 0:
            for k in range(4):
                comm.send(numpy.array([k], dtype=numpy.int64), 1, tag=5)
            return None
        return [int(comm.recv_(numpy.empty(1, dtype=numpy.int64), 0, tag=5)[0])
                for _ in range(4)]

    assert run_ranks(2, fn)[1] == [0, 1, 2, 3]


def test_a_receive_of_another_shape_names_both_ranks_and_both_call_sites():
    def fn(comm):
        if comm.rank == 0:
            comm.send(numpy.zeros((2, 3)), 1)
        else:
            comm.recv_(numpy.empty((3, 2)), 0)

    with pytest.raises(DistributedError, match=r"irecv_ on rank 1: rank 0 sent shape \(2, 3\)"
                       r" float64 \(at test_point_to_point.py:\d+ in fn\), this rank receives "
                       r"shape \(3, 2\)"):
        run_ranks(2, fn)


def test_a_receive_whose_sender_never_sends_names_the_sender():
    def fn(comm):
        if comm.rank == 1:
            comm.recv_(numpy.empty(2), 0, tag=3)

    with pytest.raises(DistributedError, match="message #1 with tag 3 from rank 0 to rank 1.*"
                       "rank 0 returned from its function without sending it"):
        run_ranks(2, fn)


def test_a_rank_alone_receives_what_it_sent_itself():
    comm = SingleCommunicator()
    comm.send(numpy.arange(3.0), 0, tag=2)
    assert comm.recv_(numpy.empty(3), 0, tag=2).tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(DistributedError, match="no message of that tag"):
        comm.recv_(numpy.empty(3), 0, tag=2)
    with pytest.raises(ValueError, match="tag=-1"):
        comm.send(numpy.zeros(1), 0, tag=-1)


def test_point_to_point_calls_are_numbered_apart_from_the_collectives():
    book = L.Ledger("pipe", (4, 5))
    first = book.begin("allreduce_")
    recv = book.begin("irecv_", peer=5)
    second = book.begin("barrier")
    assert (first.seq, recv.seq, second.seq) == (1, 1, 2)
    assert recv.describe().startswith("irecv_ p2p #1 from world rank 5 at test_point_to_point")


def test_the_watchdog_report_of_a_receive_names_the_peer_it_waits_for():
    wait = {"seq": 2, "op": "irecv_", "site": "pipeline.py:9 in run", "start": 90.0,
            "end": 0.0, "patient": "", "peer": 0}
    states = {1: {"rank": 1, "now": 100.0, "exiting": None,
                  "ledgers": [{"key": "comm3", "world_ranks": [0, 1], "seq": 0,
                               "inflight": wait, "recent": []}]},
              0: {"rank": 0, "now": 100.0, "exiting": None,
                  "ledgers": [{"key": "comm3", "world_ranks": [0, 1], "seq": 0,
                               "inflight": None, "recent": []}]}}
    report = W.format_report("rank 1 waited too long", states, 2, {},
                             {"key": "comm3", "seq": 2, "op": "irecv_",
                              "site": "pipeline.py:9 in run", "peer": 0})
    assert "irecv_ p2p #2 at pipeline.py:9 in run on 'comm3' is point-to-point: it waits " \
           "for world rank 0 only" in report
    assert "rank 1: in irecv_ p2p #2 from world rank 0 at pipeline.py:9" in report
    assert "never arrived" not in report
