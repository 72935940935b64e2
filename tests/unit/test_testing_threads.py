"""Thread ranks (mpidl.testing.threads): MPI's semantics at 1-4 ranks in one process.

Expected values are functions of rank and size, as in tests/mpi; the wrappers' test is
the signature one: N thread ranks x b samples equal 1 rank x N*b in float64.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time

import numpy
import pytest

from mpidl.autograd import is_grad_enabled, no_grad
from mpidl.comm import DistributedError, split_counts
from mpidl.comm import datatypes
from mpidl.comm.hierarchical import HierarchicalCommunicator
from mpidl.functions import softmax_cross_entropy
from mpidl.models import gpt, mlp
from mpidl.optim import AdamW
from mpidl.parallel import (DataParallel, ProcessGrid, ShardedDataParallel, compression,
                            parallel_gpt)
from mpidl.testing import allclose, assert_allclose_all_ranks, run_ranks
from mpidl.testing.threads import Call

SIZES = [1, 2, 3, 4]
BATCH = 13


def each_rank(size, fn, **options):
    """``fn(comm)`` on every rank, its results in rank order (a short timeout)."""
    return run_ranks(size, fn, timeout=options.pop("timeout", 5.0), **options)


# -- reductions ----------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_allreduce_sums_maxes_and_mins_in_place_on_every_rank(size):
    def body(comm):
        x = numpy.arange(5.0) + comm.rank
        got = comm.allreduce_(x)
        return got is x, x, comm.allreduce_(numpy.arange(5.0) * (comm.rank + 1), op="max"), \
            comm.allreduce_(numpy.arange(5.0) - comm.rank, op="MIN"), \
            comm.allreduce_(numpy.array([comm.rank + 1]), op="prod")

    for same, total, high, low, prod in each_rank(size, body):
        assert same
        numpy.testing.assert_array_equal(total, size * numpy.arange(5.0) + size * (size - 1) / 2)
        numpy.testing.assert_array_equal(high, numpy.arange(5.0) * size)
        numpy.testing.assert_array_equal(low, numpy.arange(5.0) - (size - 1))
        assert prod.tolist() == [numpy.prod(numpy.arange(1, size + 1))]


@pytest.mark.parametrize("size", SIZES)
def test_allreduce_returns_a_fresh_array_and_leaves_x_alone(size):
    def body(comm):
        x = numpy.full((2, 2), comm.rank, dtype=numpy.int32)
        y = comm.allreduce(x)
        return x, y

    for r, (x, y) in enumerate(each_rank(size, body)):
        assert (x == r).all() and (y == size * (size - 1) // 2).all()


@pytest.mark.parametrize("size", [1, 3])
def test_no_result_is_a_view_of_another_ranks_array(size):
    def body(comm):
        x = numpy.arange(size * 2.0).reshape(size, 2)
        return [x, comm.allreduce(x), comm.allgather(x), comm.allgatherv(x),
                comm.reduce_scatter(x), comm.alltoall(x), comm.iallgather(x).wait(),
                comm.sendrecv(x, dest=(comm.rank + 1) % size, source=(comm.rank - 1) % size)]

    arrays = [a for result in each_rank(size, body) for a in result]
    assert not any(numpy.shares_memory(a, b)
                   for i, a in enumerate(arrays) for b in arrays[i + 1:])


@pytest.mark.parametrize("size", SIZES)
def test_reduce_writes_only_roots_array(size):
    root = size - 1

    def body(comm):
        return comm.reduce_(numpy.full(3, comm.rank + 1.0), root=root, op="sum")

    for r, x in enumerate(each_rank(size, body)):
        want = size * (size + 1) / 2 if r == root else r + 1.0
        numpy.testing.assert_array_equal(x, numpy.full(3, want))


@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter_gives_rank_r_its_uneven_block_of_the_sum(size):
    rows = 2 * size + 1  # never divisible: the first rows % size blocks are one longer

    def body(comm):
        x = numpy.arange(rows * 2, dtype=numpy.float64).reshape(rows, 2) * (comm.rank + 1)
        return comm.reduce_scatter(x)

    full = numpy.arange(rows * 2, dtype=numpy.float64).reshape(rows, 2) * (size * (size + 1) / 2)
    counts = split_counts(rows, size)
    for r, block in enumerate(each_rank(size, body)):
        start = sum(counts[:r])
        numpy.testing.assert_array_equal(block, full[start:start + counts[r]])
    assert split_counts(7, 3) == [3, 2, 2]


@pytest.mark.parametrize("size", SIZES)
def test_float16_sums_as_float16_in_rank_order(size):
    def body(comm):
        # 2048 + 1 is a tie in float16 (spacing 2): it rounds to even, 2048, every time.
        x = numpy.array([comm.rank + 0.5, 2048.0 if comm.rank == 0 else 1.0], numpy.float16)
        return comm.allreduce_(x)

    for x in each_rank(size, body):
        assert x.dtype == numpy.float16
        assert x.tolist() == [size * size / 2, 2048.0]


def test_float16_max_and_booleans_are_refused_on_every_rank_as_by_mpi():
    def body(comm, x, op):
        with pytest.raises(TypeError) as raised:
            comm.allreduce_(x, op=op)
        return str(raised.value)

    messages = each_rank(2, body, x=numpy.ones(2, numpy.float16), op="max")
    assert all("astype(numpy.float32)" in m for m in messages)
    messages = each_rank(2, body, x=numpy.ones(2, bool), op="sum")
    assert all("bool array" in m for m in messages)


def test_an_in_place_collective_refuses_a_strided_array_as_mpi_does():
    def body(comm):
        comm.allreduce_(numpy.zeros((4, 4))[:, ::2])

    with pytest.raises(ValueError, match="C-contiguous"):
        each_rank(2, body)


@pytest.fixture
def wire_ops(monkeypatch):
    """Stand-ins for the 16-bit wire sums, so no MPI is initialised in unit tests (as in
    test_comm_device): ``wire_sum_op`` returns them, and the threads find them there."""
    monkeypatch.setattr(datatypes, "_float16_sum", object())
    monkeypatch.setattr(compression, "_ops", {"bfloat16": object()})


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("wire_dtype, tie", [("float16", 2048.0), ("bfloat16", 256.0)])
def test_the_16_bit_wire_sums_add_in_their_format(wire_ops, size, wire_dtype, tie):
    def body(comm):
        # Exact small sums, and a tie (tie + 1 is halfway to the next value) that rounds
        # back to even each time the format's adds run.
        flat = numpy.array([comm.rank + 1.0, tie if comm.rank == 0 else 1.0], numpy.float32)
        packed = compression.compress(flat, wire_dtype)
        comm.allreduce_(packed, op=compression.wire_sum_op(wire_dtype))
        compression.decompress(packed, wire_dtype, flat)
        block = comm.reduce_scatter(compression.compress(numpy.full(size, 2.0), wire_dtype),
                                    op=compression.wire_sum_op(wire_dtype))
        return flat, block, comm.calls[0].op

    for flat, block, op in each_rank(size, body):
        assert flat.tolist() == [size * (size + 1) / 2, tie]
        assert block.dtype == numpy.uint16 and block.shape == (1,)
        out = numpy.empty(1)
        compression.decompress(block, wire_dtype, out)
        assert out.tolist() == [2.0 * size] and op == f"{wire_dtype} wire sum"


def test_an_unknown_custom_op_is_refused_naming_what_is_known(wire_ops):
    def body(comm):
        comm.allreduce_(numpy.zeros(2, numpy.uint16), op=object())

    with pytest.raises(TypeError, match="wire sums"):
        each_rank(2, body)


# -- data movement -------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_bcast_from_a_non_zero_root_overwrites_the_others(size):
    root = size // 2

    def body(comm):
        x = numpy.full((2, 3), float(comm.rank))
        return comm.bcast_(x, root=root) is x, x

    for same, x in each_rank(size, body):
        assert same and (x == root).all()


@pytest.mark.parametrize("size", SIZES)
def test_allgather_stacks_row_r_from_rank_r(size):
    def body(comm):
        return comm.allgather(numpy.array([comm.rank, 10 * comm.rank])), \
            comm.iallgather(numpy.float64(comm.rank)).wait()

    for stacked, scalars in each_rank(size, body):
        assert stacked.tolist() == [[r, 10 * r] for r in range(size)]
        assert scalars.shape == (size,) and scalars.tolist() == list(range(size))


@pytest.mark.parametrize("size", SIZES)
def test_allgatherv_joins_uneven_rows_and_empty_ones(size):
    def body(comm):
        return comm.allgatherv(numpy.full((comm.rank, 2), comm.rank))  # rank 0: no rows

    want = [[r, r] for r in range(size) for _ in range(r)]
    for joined in each_rank(size, body):
        assert joined.shape == (size * (size - 1) // 2, 2) and joined.tolist() == want


@pytest.mark.parametrize("size", SIZES)
def test_alltoall_sends_block_j_to_rank_j(size):
    def body(comm):
        return comm.alltoall(numpy.array([[10 * comm.rank + j] for j in range(size)]))

    for r, y in enumerate(each_rank(size, body)):
        assert y.tolist() == [[10 * i + r] for i in range(size)]


@pytest.mark.parametrize("size", SIZES)
def test_objects_are_copies_no_rank_shares_with_another(size):
    def body(comm):
        got = comm.bcast_obj({"from": comm.rank, "items": []} if comm.rank == 1 % size
                             else None, root=1 % size)
        got["items"].append(comm.rank)  # another rank's copy must not see this
        comm.barrier()
        return got, comm.allgather_obj((comm.rank, [comm.rank]))

    for r, (got, everyone) in enumerate(each_rank(size, body)):
        assert got == {"from": 1 % size, "items": [r]}
        assert everyone == [(q, [q]) for q in range(size)]


def test_an_object_mpi_cannot_pickle_fails_here_too():
    def body(comm):
        comm.allgather_obj(lambda: None)

    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        each_rank(2, body)


# -- point to point ------------------------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_a_ring_of_isendrecv_completes_in_any_start_and_wait_order(size):
    def body(comm):
        right, left = (comm.rank + 1) % size, (comm.rank - 1) % size
        if comm.rank == 0:
            time.sleep(0.05)  # the others start (and wait) before rank 0 has sent
        requests = [comm.isendrecv(numpy.array([comm.rank, k]), right, left) for k in range(3)]
        order = [2, 0, 1] if comm.rank % 2 else [0, 1, 2]
        got = {k: requests[k].wait() for k in order}
        back = comm.sendrecv(numpy.array([comm.rank, 9]), dest=left, source=right)
        return [got[k].tolist() for k in range(3)], back.tolist()

    for r, (got, back) in enumerate(each_rank(size, body)):
        assert got == [[(r - 1) % size, k] for k in range(3)]  # in start order (FIFO)
        assert back == [(r + 1) % size, 9]


def test_a_receive_that_never_comes_names_source_and_dest():
    def body(comm):
        if comm.rank == 1:
            return comm.isendrecv(numpy.zeros(1), dest=1, source=0).wait()  # 0 never sends
        time.sleep(1.0)  # alive, but busy elsewhere, past the time given to stragglers

    started = time.monotonic()
    errors = run_ranks(2, body, timeout=0.3, return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in errors)
    assert "rank 0 did not return within 0.3 s after a rank failed" in str(errors[0])
    assert "rank 1 waits in #1 isendrecv(shape (1,), float64, dest=1, source=0) " \
           "(message #1 from rank 0 to rank 1): rank 0 did not send it within 0.3 s" \
           in str(errors[1])
    assert time.monotonic() - started < 2


# -- agreement: mismatches, missing and failing ranks ----------------------------------------
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("case, ranks_1_call", [
    ("name", "bcast_(shape (3,), float64, root=0)"),
    ("shape", "allreduce_(shape (4,), float64, op=sum)"),
    ("op", "allreduce_(shape (3,), float64, op=max)"),
])
def test_a_mismatched_collective_raises_on_every_rank_naming_each_call(size, case, ranks_1_call):
    def body(comm):
        comm.barrier()
        odd = comm.rank == 1
        with pytest.raises(DistributedError) as raised:
            if case == "name" and odd:
                comm.bcast_(numpy.zeros(3))
            else:
                comm.allreduce_(numpy.zeros(4 if case == "shape" and odd else 3),
                                op="max" if case == "op" and odd else "sum")
        comm.barrier()  # the group still works after the mismatch
        return str(raised.value), raised.value.failed_ranks

    for message, failed in each_rank(size, body):
        assert "collective mismatch in collective #2 of 'world'" in message
        assert "rank 0: #2 allreduce_(shape (3,), float64, op=sum)" in message
        assert f"rank 1: #2 {ranks_1_call}" in message
        assert "test_testing_threads.py" in message and failed == [1]


def test_a_different_root_is_a_mismatch():
    def body(comm):
        comm.bcast_obj("x", root=comm.rank)

    errors = each_rank(2, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) for e in errors)
    assert "rank 0: #1 bcast_obj(root=0)" in str(errors[0])
    assert "rank 1: #1 bcast_obj(root=1)" in str(errors[1])


def test_non_blocking_collectives_started_in_another_order_are_a_mismatch():
    def body(comm):
        a, b = numpy.zeros(2), numpy.zeros(3)
        first, second = (a, b) if comm.rank == 0 else (b, a)
        reqs = [comm.iallreduce_(first), comm.iallreduce_(second)]
        for r in reqs:
            r.wait()

    errors = each_rank(2, body, return_exceptions=True)
    assert all(isinstance(e, DistributedError) and "mismatch" in str(e) for e in errors)


def test_a_rank_that_returns_before_a_collective_is_named_at_once():
    def body(comm):
        if comm.rank == 2:
            return "left early"
        comm.allreduce_(numpy.zeros(3))

    started = time.monotonic()
    errors = run_ranks(3, body, timeout=1.0, return_exceptions=True)
    assert errors[2] == "left early" and isinstance(errors[1], DistributedError)
    assert isinstance(errors[0], DistributedError) and errors[0].failed_ranks == [2]
    assert "rank 0 waits in #1 allreduce_(shape (3,), float64, op=sum) (collective #1 of " \
           "'world'), but rank 2 returned from its function without calling it" in str(errors[0])
    assert time.monotonic() - started < 1.0


def test_a_rank_that_never_arrives_is_named_after_the_timeout():
    def body(comm):
        if comm.rank == 2:
            time.sleep(0.6)  # stuck elsewhere; then it finds the group broken
        started = time.monotonic()
        try:
            comm.allreduce_(numpy.zeros(3))
        except DistributedError as e:
            return str(e), time.monotonic() - started

    results = run_ranks(3, body, timeout=0.3)
    for message, waited in results[:2]:
        assert "rank 2 never arrived within 0.3 s" in message and "allreduce_" in message
        assert 0.25 < waited < 0.9
    assert "that a timeout broke" in results[2][0]


def test_an_exception_on_one_rank_reaches_the_caller_with_its_rank_at_once():
    def body(comm):
        if comm.rank == 1:
            raise ValueError("bad shard on this rank")
        comm.barrier()

    started = time.monotonic()
    with pytest.raises(ValueError, match="bad shard") as raised:
        run_ranks(3, body, timeout=20.0)
    assert time.monotonic() - started < 2.0  # not the 20 s timeout
    notes = getattr(raised.value, "__notes__", None) or [str(raised.value.__cause__)]
    assert "raised on rank 1 of 3" in notes[0]


def test_the_lowest_rank_with_its_own_error_is_reported_not_the_aborted_ones():
    def body(comm):
        if comm.rank == 2:
            raise KeyError("first-hand")
        comm.barrier()

    errors = run_ranks(3, body, return_exceptions=True)
    assert isinstance(errors[2], KeyError)
    assert all(isinstance(e, DistributedError) and "raised KeyError" in str(e)
               for e in errors[:2])
    with pytest.raises(KeyError, match="first-hand"):
        run_ranks(3, body)


def test_a_rank_stuck_outside_any_call_is_left_behind_and_named():
    def body(comm):
        if comm.rank == 0:
            time.sleep(1.0)  # computing, never reaching a call that could abort it
        else:
            raise RuntimeError("rank 1 broke")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 broke") as raised:
        run_ranks(2, body, timeout=0.2)
    assert time.monotonic() - started < 0.9
    notes = getattr(raised.value, "__notes__", None) or [str(raised.value.__cause__)]
    assert "raised on rank 1 of 2 (mpidl.testing.run_ranks); rank 0 never returned" in notes


@pytest.mark.parametrize("size", [1, 3])
def test_check_raises_on_every_rank_with_the_failing_ranks_messages(size):
    def body(comm):
        with pytest.raises(DistributedError, match=f"rank {size - 1}: not ready") as raised:
            comm.check(comm.rank != size - 1, "not ready")
        return raised.value.failed_ranks

    assert each_rank(size, body) == [[size - 1]] * size


# -- groups --------------------------------------------------------------------------------
def test_split_orders_by_key_then_rank_and_collectives_stay_in_the_group():
    def body(comm):
        sub = comm.split(comm.rank % 2, key=-comm.rank)  # reversed within each color
        members = sub.allgather(numpy.array(comm.rank)).tolist()
        total = sub.allreduce_(numpy.array([comm.rank]))
        sub.free()
        sub.free()  # a second free does nothing, as on MPI
        with pytest.raises(ValueError, match="freed"):
            sub.barrier()
        return sub.rank, sub.size, members, total.tolist()

    results = each_rank(5, body)
    assert [r[:3] for r in results] == [
        (2, 3, [4, 2, 0]), (1, 2, [3, 1]), (1, 3, [4, 2, 0]), (0, 2, [3, 1]), (0, 3, [4, 2, 0])]
    assert [r[3] for r in results] == [[6], [4], [6], [4], [6]]


def test_ranks_per_node_sets_local_ranks_in_the_world_and_in_split_groups():
    def body(comm):
        odd = comm.split(comm.rank % 2)
        return comm.local_rank, comm.local_size, odd.local_rank, odd.local_size

    # nodes {0, 1}, {2, 3}, {4}; the even group {0, 2, 4} has one rank on each
    assert each_rank(5, body, ranks_per_node=2) == [
        (0, 2, 0, 1), (1, 2, 0, 1), (0, 2, 0, 1), (1, 2, 0, 1), (0, 1, 0, 1)]
    assert each_rank(3, body)[2] == (2, 3, 1, 2)  # one node: ranks 0 and 2 share it
    assert not hasattr(each_rank(1, lambda comm: comm)[0], "node_comm")


@pytest.mark.parametrize("size, per_node", [(4, 2), (3, 2), (3, 1)])
def test_a_hierarchical_allreduce_over_thread_ranks_is_the_flat_one(size, per_node):
    def body(comm):
        reducer = HierarchicalCommunicator(comm, ranks_per_node=per_node)
        x = reducer.allreduce_(numpy.arange(4.0) * (comm.rank + 1))
        reducer.free()
        return x

    for x in each_rank(size, body, ranks_per_node=per_node):
        numpy.testing.assert_array_equal(x, numpy.arange(4.0) * size * (size + 1) / 2)


# -- what the record shows -------------------------------------------------------------------
def test_every_call_is_recorded_point_to_point_marked():
    def body(comm):
        comm.barrier()
        comm.allgather_obj(1)
        comm.sendrecv(numpy.zeros(2, numpy.float32), dest=0, source=0)
        comm.bcast_(numpy.zeros(3), root=0)
        return comm.calls

    (calls,) = each_rank(1, body)
    assert calls == [
        Call(1, "barrier"), Call(2, "allgather_obj"),
        Call(3, "sendrecv", (2,), "float32", nbytes=8, point_to_point=True, dest=0, source=0),
        Call(4, "bcast_", (3,), "float64", root=0, nbytes=24)]
    assert calls[0].site.startswith("test_testing_threads.py:")


def test_grad_mode_is_per_rank_thread():
    def body(comm):
        if comm.rank == 0:
            with no_grad():
                comm.barrier()  # rank 1 looks while rank 0 is inside no_grad
                comm.barrier()
            return None
        comm.barrier()
        enabled = is_grad_enabled()
        comm.barrier()
        return enabled

    assert each_rank(2, body) == [None, True]
    assert threading.current_thread() is threading.main_thread()


# -- the wrappers: N thread ranks x b samples equal 1 rank x N*b -------------------------------
def batches():
    rng = numpy.random.default_rng(0)
    return [(rng.standard_normal((BATCH, 7)), rng.integers(0, 5, size=BATCH)) for _ in range(2)]


def small_mlp():
    return mlp(sizes=(7, 11, 5), seed=4, dtype="float64")


def adamw(params):
    return AdamW(params, lr=1e-2, weight_decay=0.1)


def share(comm, x, y):
    counts = split_counts(len(x), comm.size)
    start = sum(counts[:comm.rank])
    return x[start:start + counts[comm.rank]], y[start:start + counts[comm.rank]]


@pytest.fixture(scope="module")
def reference():
    """The single-rank model's parameters after the steps over the whole batch."""
    model = small_mlp()
    opt = adamw(model.parameters())
    for x, y in batches():
        loss = softmax_cross_entropy(model(x), y, reduction="sum") * (1.0 / len(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.data for p in model.parameters()]


def data_parallel(comm, data, **options):
    model = small_mlp()
    dp = DataParallel(model, comm, shared_memory=False, **options)
    opt = adamw(model.parameters())
    for x, y in data:
        xs, ys = share(comm, x, y)
        dp.backward(softmax_cross_entropy(dp(xs), ys, reduction="sum"), global_count=len(x))
        opt.step()
        opt.zero_grad()
    dp.close()
    return [p.data for p in model.parameters()]


def sharded(comm, data, stage):
    model = small_mlp()
    sdp = ShardedDataParallel(model, comm, stage=stage)
    opt = adamw(sdp.parameters())
    for x, y in data:
        xs, ys = share(comm, x, y)
        sdp.backward(softmax_cross_entropy(sdp(xs), ys, reduction="sum"), global_count=len(x))
        opt.step()
        opt.zero_grad()
    # The full parameters after the last step, as tests/mpi/test_zero.py gathers them.
    sdp.gather_parameters()
    names, full = {id(p): n for n, p in sdp.named}, {}
    for u in sdp.units:
        if u.flat is None:
            sdp.gathers.gather(u)
        full.update((names[id(p)], p.data.copy()) for p in u.params)
        if sdp.stage == 3:
            u.release_params()
    sdp.close()
    return [full[n] for n, _ in sdp.named]


def compare_on_every_rank(comm, train, reference, *args, **options):
    params = train(comm, batches(), *args, **options)
    dtype = "bfloat16" if options.get("compression") else None
    for k, (p, q) in enumerate(zip(params, reference)):
        assert_allclose_all_ranks(comm, p, q, dtype=dtype, scale=10.0, what=f"parameter {k}")
    return len(params)


@pytest.mark.parametrize("size", [2, 3])
def test_data_parallel_over_thread_ranks_equals_one_rank(reference, size):
    assert each_rank(size, compare_on_every_rank, train=data_parallel,
                     reference=reference) == [4] * size


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_data_parallel_over_thread_ranks_equals_one_rank(reference, size, stage):
    def body(comm):
        return compare_on_every_rank(comm, sharded, reference, stage)

    assert each_rank(size, body) == [4] * size


def test_hierarchical_bfloat16_data_parallel_across_thread_nodes_stays_close(reference,
                                                                            wire_ops):
    def body(comm):
        return compare_on_every_rank(comm, data_parallel, reference, hierarchical=2,
                                     compression="bfloat16")

    assert each_rank(4, body, ranks_per_node=2) == [4] * 4


@pytest.mark.parametrize("overlap, name", [(False, "allreduce_"), (True, "iallreduce_")])
def test_a_data_parallel_backward_makes_one_allreduce_per_bucket(overlap, name):
    def body(comm):
        model = small_mlp()
        dp = DataParallel(model, comm, shared_memory=False, overlap=overlap, bucket_mb=0.001)
        x, y = share(comm, *batches()[0])
        loss = softmax_cross_entropy(dp(x), y, reduction="sum")
        before = len(comm.calls)
        dp.backward(loss, global_count=BATCH)
        calls = [(c.name, c.shape, c.dtype, c.op) for c in comm.calls[before:]]
        shapes = [b.flat.shape for b in dp.buckets]
        dp.close()
        return calls, shapes

    for calls, shapes in each_rank(3, body):
        assert len(shapes) >= 2  # several buckets, each one allreduce, in bucket order
        assert calls == [(name, s, "float64", "sum") for s in shapes]


def test_a_tensor_parallel_gpt_over_thread_ranks_has_the_single_rank_loss():
    kw = dict(vocab=13, seq_len=8, dim=12, layers=1, heads=6, seed=4, dtype="float64")
    ids = numpy.random.default_rng(0).integers(0, 13, (2, 8))
    want = gpt(**kw).loss(ids).data

    def body(comm):
        grid = ProcessGrid(comm, tensor=comm.size)
        loss = parallel_gpt(grid, **kw).loss(ids)
        loss.backward()
        return loss.data, [c.name for c in grid.tensor.calls]

    for loss, names in each_rank(3, body):
        assert allclose(loss, want) and "allreduce_" in names


# -- the real MPI ops ----------------------------------------------------------------------
def test_the_real_mpi_wire_ops_are_recognised():
    pytest.importorskip("mpi4py")
    code = (
        "import numpy\n"
        "from mpidl.parallel import compression as c\n"
        "from mpidl.testing import run_ranks\n"
        "def body(comm):\n"
        "    out = []\n"
        "    for d in ('bfloat16', 'float16'):\n"
        "        x = c.compress(numpy.full(2, 1.5), d)\n"
        "        comm.allreduce_(x, op=c.wire_sum_op(d))\n"
        "        y = numpy.empty(2); c.decompress(x, d, y); out.append(y.tolist())\n"
        "    return out\n"
        "print(run_ranks(2, body))\n")
    # A process of its own: unit tests do not initialise MPI (a singleton, no launcher).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "PMIX_", "SLURM_", "MPIDL_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([[[3.0, 3.0], [3.0, 3.0]]] * 2)
