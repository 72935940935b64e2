"""Every collective of the Communicator, on every rank, at any size.

Expected values are functions of rank and size; each test ends in a collective verdict.
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.comm import DistributedError, split_counts
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks, raises_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

DTYPES = ["float32", "float64", "int32", "int64"]


def ranked(xp, shape, dtype, rank):
    """A deterministic array that differs per rank: value = 10*rank + flat index."""
    n = int(numpy.prod(shape))
    return (xp.arange(n) + 10 * rank).reshape(shape).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_sums_every_rank_in_place(comm, xp, dtype):
    x = ranked(xp, (3, 4), dtype, comm.rank)
    out = comm.allreduce_(x)
    expected = sum(ranked(numpy, (3, 4), dtype, r) for r in range(comm.size))
    assert_all_ranks(comm, out is x, "allreduce_ did not return its argument")
    assert_allclose_all_ranks(comm, x, expected.astype(dtype), what="allreduce_ sum")


@pytest.mark.parametrize("op, reduce", [("max", max), ("min", min)])
def test_allreduce_max_and_min(comm, xp, op, reduce):
    x = xp.full(5, comm.rank * 2 - 1, dtype="int64")
    comm.allreduce_(x, op=op)
    expected = reduce(r * 2 - 1 for r in range(comm.size))
    assert_allclose_all_ranks(comm, x, numpy.full(5, expected, dtype="int64"), what=op)


def test_allreduce_returns_new_array_and_keeps_input(comm, xp):
    x = ranked(xp, (4,), "float64", comm.rank)
    before = x.copy()
    y = comm.allreduce(x)
    expected = sum(ranked(numpy, (4,), "float64", r) for r in range(comm.size))
    assert_allclose_all_ranks(comm, x, before, what="input changed")
    assert_allclose_all_ranks(comm, y, expected, what="allreduce")


def test_allreduce_rejects_unknown_op_on_every_rank(comm):
    with raises_all_ranks(comm, ValueError, match="unknown reduction op 'avg'"):
        comm.allreduce_(numpy.zeros(2), op="avg")


@pytest.mark.parametrize("dtype", DTYPES)
def test_bcast_overwrites_non_root_ranks(comm, xp, dtype):
    root = comm.size - 1
    x = ranked(xp, (2, 3), dtype, comm.rank)
    comm.bcast_(x, root=root)
    assert_allclose_all_ranks(comm, x, ranked(numpy, (2, 3), dtype, root), what="bcast_")


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_stacks_rank_arrays_in_rank_order(comm, xp, dtype):
    out = comm.allgather(ranked(xp, (2, 2), dtype, comm.rank))
    expected = numpy.stack([ranked(numpy, (2, 2), dtype, r) for r in range(comm.size)])
    assert_allclose_all_ranks(comm, out, expected, what="allgather")


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgatherv_concatenates_uneven_blocks_including_empty(comm, xp, dtype):
    rows = comm.rank % 3  # rank 0 sends nothing
    x = (xp.ones((rows, 2)) * (comm.rank + 1)).astype(dtype)
    out = comm.allgatherv(x)
    expected = numpy.concatenate(
        [numpy.ones((r % 3, 2), dtype=dtype) * (r + 1) for r in range(comm.size)])
    assert_allclose_all_ranks(comm, out, expected.astype(dtype), what="allgatherv")


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_gives_each_rank_its_block_of_the_sum(comm, xp, dtype):
    n = 2 * comm.size + 1  # uneven blocks at size > 1
    x = ranked(xp, (n, 3), dtype, comm.rank)
    mine = comm.reduce_scatter(x)
    total = sum(ranked(numpy, (n, 3), dtype, r) for r in range(comm.size)).astype(dtype)
    counts = split_counts(n, comm.size)
    start = sum(counts[:comm.rank])
    assert_allclose_all_ranks(comm, mine, total[start:start + counts[comm.rank]],
                              what="reduce_scatter")


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_transposes_blocks_between_ranks(comm, xp, dtype):
    # block j of rank i holds 100*i + j
    x = (xp.arange(comm.size)[:, None] + 100 * comm.rank + xp.zeros((1, 3))).astype(dtype)
    y = comm.alltoall(x)
    expected = (numpy.arange(comm.size)[:, None] * 100 + comm.rank
                + numpy.zeros((1, 3))).astype(dtype)
    assert_allclose_all_ranks(comm, y, expected, what="alltoall")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sendrecv_shifts_around_a_ring(comm, xp, dtype):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = comm.sendrecv(ranked(xp, (4,), dtype, comm.rank), dest=right, source=left)
    assert_allclose_all_ranks(comm, got, ranked(numpy, (4,), dtype, left), what="sendrecv")


@pytest.mark.parametrize("dtype", DTYPES)
def test_isendrecv_passes_two_rings_at_once_while_the_caller_works(comm, xp, dtype):
    # Ring attention's backward: K/V go right while the gradient buffer follows them,
    # both in flight during the block's compute; they must match in the order started.
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x, y = ranked(xp, (5,), dtype, comm.rank), ranked(xp, (2, 3), dtype, 2 * comm.rank + 1)
    first = comm.isendrecv(x, dest=right, source=left)
    second = comm.isendrecv(y, dest=right, source=left)
    work = float(xp.sum(x))  # the sent arrays may be read meanwhile
    first.test()
    got_y, got_x = second.wait(), first.wait()
    assert_all_ranks(comm, first.test() and second.test() and work == float(xp.sum(x)),
                     "the handles did not complete, or the sent array changed")
    assert_allclose_all_ranks(comm, got_x, ranked(numpy, (5,), dtype, left), what="first")
    assert_allclose_all_ranks(comm, got_y, ranked(numpy, (2, 3), dtype, 2 * left + 1),
                              what="second")


@pytest.mark.parametrize("dtype", DTYPES)
def test_iallreduce_completes_on_wait(comm, xp, dtype):
    x = ranked(xp, (6,), dtype, comm.rank)
    req = comm.iallreduce_(x)
    req.test()  # progress; may or may not be complete yet
    out = req.wait()
    expected = sum(ranked(numpy, (6,), dtype, r) for r in range(comm.size)).astype(dtype)
    assert_all_ranks(comm, out is x and req.test(), "wait() must return x and complete")
    assert_allclose_all_ranks(comm, x, expected, what="iallreduce_")


def test_large_messages_are_chunked(comm, xp):
    """A message larger than max_message_bytes goes in several MPI calls, same result.

    (2 GiB messages are too large for CI; the limit is lowered to 64 bytes instead.)
    """
    if not hasattr(comm, "max_message_bytes"):
        pytest.skip("size-1 communicator sends no messages")
    old = comm.max_message_bytes
    comm.max_message_bytes = 64
    try:
        x = ranked(xp, (10, 7), "float64", comm.rank)  # 560 bytes -> 9 chunks
        comm.allreduce_(x)
        total = sum(ranked(numpy, (10, 7), "float64", r) for r in range(comm.size))
        b = ranked(xp, (10, 7), "int32", comm.rank)
        comm.bcast_(b, root=0)
        g = comm.allgather(ranked(xp, (5, 5), "int64", comm.rank))
        ring = comm.sendrecv(ranked(xp, (33,), "int32", comm.rank),
                             dest=(comm.rank + 1) % comm.size, source=(comm.rank - 1) % comm.size)
        req = comm.iallreduce_(ranked(xp, (40,), "float32", comm.rank))
        ir = req.wait()
        iring = comm.isendrecv(ranked(xp, (35,), "int64", comm.rank),
                               dest=(comm.rank + 1) % comm.size,
                               source=(comm.rank - 1) % comm.size).wait()
    finally:
        comm.max_message_bytes = old
    assert_allclose_all_ranks(comm, x, total, what="chunked allreduce_")
    assert_allclose_all_ranks(comm, b, ranked(numpy, (10, 7), "int32", 0), what="chunked bcast_")
    assert_allclose_all_ranks(
        comm, g, numpy.stack([ranked(numpy, (5, 5), "int64", r) for r in range(comm.size)]),
        what="chunked allgather")
    left = (comm.rank - 1) % comm.size
    assert_allclose_all_ranks(comm, ring, ranked(numpy, (33,), "int32", left),
                              what="chunked sendrecv")
    assert_allclose_all_ranks(comm, iring, ranked(numpy, (35,), "int64", left),
                              what="chunked isendrecv")
    assert_allclose_all_ranks(
        comm, ir, sum(ranked(numpy, (40,), "float32", r) for r in range(comm.size)),
        what="chunked iallreduce_")


def test_a_large_reduce_scatter_gives_each_rank_its_block_of_uneven_rows(comm, xp):
    """Above max_message_bytes reduce_scatter sums the whole array in chunks and keeps
    this rank's rows: block r starts after every block before it, the longer ones too."""
    if not hasattr(comm, "max_message_bytes"):
        pytest.skip("size-1 communicator sends no messages")
    n = 2 * comm.size + 1  # uneven blocks at size > 1
    old = comm.max_message_bytes
    comm.max_message_bytes = 64
    try:
        mine = comm.reduce_scatter(ranked(xp, (n, 5), "float64", comm.rank))  # 40 bytes a row
    finally:
        comm.max_message_bytes = old
    total = sum(ranked(numpy, (n, 5), "float64", r) for r in range(comm.size))
    counts = split_counts(n, comm.size)
    start = sum(counts[:comm.rank])
    assert_allclose_all_ranks(comm, mine, total[start:start + counts[comm.rank]],
                              what="chunked reduce_scatter")


def test_object_collectives_carry_small_metadata(comm):
    everyone = comm.allgather_obj({"rank": comm.rank})
    root_value = comm.bcast_obj({"from": comm.rank} if comm.rank == 0 else None, root=0)
    ok = [e["rank"] for e in everyone] == list(range(comm.size)) and root_value == {"from": 0}
    assert_all_ranks(comm, ok, f"allgather_obj={everyone}, bcast_obj={root_value}")


def test_check_raises_on_every_rank_naming_the_failing_rank(comm):
    bad = comm.size - 1
    with raises_all_ranks(comm, DistributedError) as info:
        comm.check(comm.rank != bad, f"rank {comm.rank} saw a bad value 42")
    err = info.value
    ok = err.failed_ranks == [bad] and f"rank {bad}: rank {bad} saw a bad value 42" in str(err)
    assert_all_ranks(comm, ok, f"unexpected error: {err!r}")
    comm.check(True, "never shown")  # all good: no error


def test_split_groups_ranks_by_color(comm, xp):
    sub = comm.split(comm.rank % 2)
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    x = xp.array([comm.rank], dtype="int64")
    sub.allreduce_(x)
    ok = sub.size == len(members) and sub.rank == members.index(comm.rank) \
        and int(x[0]) == sum(members)
    sub.free()
    assert_all_ranks(comm, ok, f"split: size={sub.size} rank={sub.rank} sum={int(x[0])}")


def test_local_rank_and_size_describe_this_node(comm):
    # CI runs every rank on one node.
    ok = comm.local_size == comm.size and comm.local_rank == comm.rank
    assert_all_ranks(comm, ok, f"local {comm.local_rank}/{comm.local_size}")


def test_barrier_returns_on_every_rank(comm):
    comm.barrier()
    assert_all_ranks(comm, True)


def test_mismatched_collective_is_reported_in_check_mode(comm):
    if comm.size == 1 or not hasattr(comm, "check_collectives"):
        pytest.skip("a mismatch needs two ranks")
    comm.check_collectives = True
    try:
        shape = (3,) if comm.rank == 0 else (4,)
        with raises_all_ranks(comm, DistributedError, match="collective mismatch"):
            comm.allreduce_(numpy.zeros(shape))
    finally:
        comm.check_collectives = False


def test_check_mode_accepts_the_same_custom_op_on_every_rank(comm):
    # An MPI.Op's str() holds a per-process address: it must not count as a mismatch.
    if comm.size == 1 or not hasattr(comm, "check_collectives"):
        pytest.skip("custom ops need MPI")
    from mpidl.parallel.compression import wire_sum_op

    comm.check_collectives = True
    try:
        x = numpy.full(4, 1.5, dtype=numpy.float16).view(numpy.uint16)
        comm.allreduce_(x, op=wire_sum_op("float16"))
    finally:
        comm.check_collectives = False
    assert_all_ranks(comm, numpy.all(x.view(numpy.float16) == 1.5 * comm.size))


@pytest.mark.parametrize("dtype, message", [
    ("bool", "bool array: MPI has no reduction for booleans"),
    (">f4", "non-native byte order"),
])
def test_unreducible_dtypes_are_the_same_clear_error_on_any_size(comm, dtype, message):
    x = numpy.zeros(3, dtype=dtype)
    for reduce in (comm.allreduce_, comm.iallreduce_, comm.reduce_):
        with raises_all_ranks(comm, TypeError, match=message):
            reduce(x)


def test_zero_d_arrays_keep_their_shape(comm):
    x = numpy.array(float(comm.rank))
    gathered = comm.allgather(x)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = comm.sendrecv(x, dest=right, source=left)
    ok = gathered.shape == (comm.size,) and gathered.tolist() == list(range(comm.size))
    assert_all_ranks(comm, ok and got.shape == () and float(got) == left,
                     f"allgather {gathered.shape}, sendrecv {got.shape}")


def test_node_shared_arrays_rounds_back_to_back_never_mix(comm):
    # As in training: every rank rewrites its copy the moment allreduce_ returns (the
    # next backward) while slower ranks may still be writing their sums into it. Each
    # round's values are distinct, so any write that lands in the wrong round shows.
    # The ranks are skewed by work of different lengths before a round, and one rank
    # per round is slowed down inside it (a delay as it turns to each array).
    import time

    from mpidl.comm.shared import NodeSharedArrays

    if comm.local_size != comm.size:
        pytest.skip("the ranks span several nodes")
    sizes = [1, 7, 100_003, 4096]
    shared = NodeSharedArrays(comm, [numpy.zeros(n, numpy.float64) for n in sizes])
    ranks = numpy.arange(comm.size, dtype=numpy.float64)
    share = shared._share
    wrong = 0
    try:
        for k in range(60):
            for mine, n in zip(shared.local, sizes):
                mine[...] = numpy.arange(n) * (comm.rank + 1) + 1000.0 * k + comm.rank
            if (k + comm.rank) % 3 == 0:
                numpy.sort(numpy.random.default_rng(k).standard_normal(20_000))  # skew
            slow = k % 2 == 0 and k // 2 % comm.size == comm.rank
            shared._share = (lambda n, q: (time.sleep(0.0005), share(n, q))[1]) if slow \
                else share
            shared.allreduce_()
            for mine, n in zip(shared.local, sizes):
                expected = (numpy.arange(n) * (ranks + 1).sum()
                            + comm.size * 1000.0 * k + ranks.sum())
                wrong += int(not numpy.array_equal(mine, expected))
    finally:
        shared.free()
    assert_all_ranks(comm, wrong == 0)


def test_node_shared_arrays_sum_every_rank_in_place(comm):
    # Arrays smaller than the rank count (empty shares), empty, and of several dtypes;
    # summed twice, to see that the second sum starts from the first's result.
    from mpidl.comm.shared import NodeSharedArrays

    if comm.local_size != comm.size:
        pytest.skip("the ranks span several nodes")
    shapes = [(1, "float32"), (0, "float64"), (1001, "float64"), (64, "int32")]
    arrays = [ranked(numpy, (n,), dtype, comm.rank) for n, dtype in shapes]
    shared = NodeSharedArrays(comm, arrays)
    try:
        assert_all_ranks(comm, all(numpy.array_equal(a, b) for a, b in zip(shared.local, arrays)),
                         "the shared copies do not start as the arrays given")
        for rounds in (1, 2):
            shared.allreduce_()
            for (n, dtype), mine in zip(shapes, shared.local):
                total = sum(ranked(numpy, (n,), dtype, r) for r in range(comm.size))
                expected = total * comm.size ** (rounds - 1)
                assert_allclose_all_ranks(comm, mine, expected.astype(dtype))
    finally:
        shared.free()


@pytest.mark.parametrize("threshold", [-1.0, 2.0], ids=["whole-shares", "by-rows"])
def test_node_shared_tables_sum_the_marked_rows_to_the_whole_sum(comm, threshold, monkeypatch):
    # Rank r marks rows r, r + size + 1, ... and row 5 (every rank: summed over all),
    # zero elsewhere; row 36 nobody marks. Summed whole or by the marked rows alone,
    # twice (the second from new values and new marks), beside an ordinary array.
    import mpidl.comm.shared as shared_module
    from mpidl.comm.shared import NodeSharedArrays

    if comm.local_size != comm.size:
        pytest.skip("the ranks span several nodes")
    monkeypatch.setattr(shared_module, "DENSE_ROWS_ABOVE", threshold)
    rows, width = 37, 3

    def table(r, k):
        marked = (numpy.arange(rows) % (comm.size + 1) == (r + k) % (comm.size + 1))
        marked[5], marked[36] = True, False
        values = ranked(numpy, (rows, width), "float64", r) * (k + 1)
        return numpy.where(marked[:, None], values, 0.0), marked

    plain = ranked(numpy, (10,), "float64", comm.rank)
    shared = NodeSharedArrays(comm, [plain, table(comm.rank, 0)[0].reshape(-1)],
                              rows=[None, rows])
    try:
        for k in (0, 1):
            mine, marked = table(comm.rank, k)
            shared.local[1][...] = mine.reshape(-1)
            shared.masks[1][...] = marked
            by_rows = shared.allreduce_()
            expected = sum(table(r, k)[0] for r in range(comm.size))
            assert_all_ranks(comm, numpy.array_equal(shared.local[1], expected.reshape(-1)),
                             f"round {k}: the table's sum differs from every rank's total")
            assert_all_ranks(comm, by_rows == (threshold > 1),
                             f"summed by rows: {by_rows} at DENSE_ROWS_ABOVE={threshold}")
        total = sum(ranked(numpy, (10,), "float64", r) for r in range(comm.size))
        assert_allclose_all_ranks(comm, shared.local[0], total * comm.size)
        assert_all_ranks(comm, shared.masks[0] is None, "an array without rows got a mask")
    finally:
        shared.free()


def test_the_ledger_numbers_collectives_alike_on_every_rank(comm):
    ledger = getattr(comm, "ledger", None)
    if ledger is None:
        pytest.skip("a size-1 communicator keeps no ledger")
    before = ledger.seq
    comm.barrier()
    comm.allreduce_(numpy.ones(2))
    comm.allgather_obj(comm.rank)
    seqs = comm.allgather_obj((ledger.seq - before, ledger.seq, ledger.key))
    assert_all_ranks(comm, seqs[0][0] == 3 and all(s == seqs[0] for s in seqs),
                     f"ledger counts differ: {seqs}")


def test_sub_communicators_get_a_name_their_ranks_agree_on(comm):
    if getattr(comm, "ledger", None) is None:
        pytest.skip("a size-1 communicator keeps no ledger")
    # Uneven groups make different numbers of communicators on different ranks first.
    extra = comm.split(comm.rank % 2)
    sub = comm.split(0)
    keys = comm.allgather_obj(sub.ledger.key)
    members = comm.allgather_obj(tuple(sub.ledger.world_ranks))
    assert_all_ranks(comm, len(set(keys)) == 1 and keys[0] != comm.ledger.key,
                     f"sub-communicator names differ: {keys}")
    assert_all_ranks(comm, all(m == tuple(range(comm.size)) for m in members), str(members))
    sub.free()
    extra.free()
