"""PowerSGD across real ranks: exact at full rank, error feedback that keeps what the
approximation lost, and compressed training that converges. Run at 1, 2 and 3 ranks::

    mpiexec -n 3 python -m pytest -p no:cacheprovider --with-mpi tests/mpi/test_powersgd.py
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.functions import softmax_cross_entropy
from mpidl.models import mlp
from mpidl.optim import SGD
from mpidl.parallel import DataParallel, PowerSGDOptions
from mpidl.parallel.powersgd import PowerSGDTransport
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks
from mpidl.train import checkpoint as ckpt
from mpidl.train.checkpointer import choose_checkpointer

from test_data_parallel import assert_same_parameters, batches, small_bow, small_mlp, \
    train_parallel, train_reference

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

SHAPES = [(6, 5), (5,), (7, 4, 2), (3, 9)]


def exact(rank=64, **options):
    """Every matrix compressed (no size threshold), the rank large enough to be exact."""
    return PowerSGDOptions(matrix_approximation_rank=rank, start_powerSGD_iter=0,
                           min_compression_rate=0.0, **options)


def local_gradients(comm, step, size):
    """This rank's gradient of every member, flat (a function of rank and step)."""
    rng = numpy.random.default_rng((comm.rank, step))
    return rng.standard_normal(size)


def every_rank_sum(comm, step, size):
    return sum(numpy.random.default_rng((r, step)).standard_normal(size)
               for r in range(comm.size))


@pytest.mark.parametrize("blocking", [True, False])
def test_at_full_rank_the_transport_sums_exactly_every_step(comm, blocking):
    size = sum(int(numpy.prod(s)) for s in SHAPES)
    t = PowerSGDTransport(comm, 1 << 20, exact(), [SHAPES])
    flat = numpy.empty(size)
    (bound,) = t.bind([flat])
    for step in range(4):  # warm-started Qs from the second step on
        bound[...] = local_gradients(comm, step, size)
        if blocking:
            t.allreduce_(bound)
        else:
            t.iallreduce_(bound).wait()
        assert_allclose_all_ranks(comm, bound, every_rank_sum(comm, step, size),
                                  scale=10, what=f"step {step}")
    assert_all_ranks(comm, t.step == 4 and t.compressing(), f"step count {t.step}")


def test_at_rank_one_the_errors_hold_exactly_what_the_approximation_lost(comm):
    size = sum(int(numpy.prod(s)) for s in SHAPES)
    options = PowerSGDOptions(matrix_approximation_rank=1, start_powerSGD_iter=0,
                              min_compression_rate=0.0)
    t = PowerSGDTransport(comm, 1 << 20, options, [SHAPES])
    flat = numpy.empty(size)
    t.bind([flat])
    flat[...] = local_gradients(comm, 0, size)
    t.allreduce_(flat)
    want = every_rank_sum(comm, 0, size)
    # the bias (5,) travels uncompressed: exact; the matrices are rank one now
    assert_allclose_all_ranks(comm, flat[30:35], want[30:35], what="uncompressed bias")
    assert_all_ranks(comm, not numpy.allclose(flat, want), "rank 1 should not be exact")
    lost = t.errors[0].copy()
    comm.allreduce_(lost)  # the ranks' errors together: the sum minus its approximation
    lost[30:35] = 0.0
    expect = want - flat
    expect[30:35] = 0.0
    assert_allclose_all_ranks(comm, lost, expect, scale=10, what="summed error feedback")
    # Error feedback: the next step sends this step's loss too. With zero gradients the
    # next sum approximates what was lost (rank one again, so the two together come
    # closer to the true sum than the first approximation alone).
    first = flat.copy()
    flat[...] = 0.0
    t.allreduce_(flat)
    before = numpy.linalg.norm(want - first)
    after = numpy.linalg.norm(want - first - flat)
    assert_all_ranks(comm, after < before, f"error feedback did not help: {after} >= {before}")


@pytest.mark.parametrize("overlap", [False, True])
def test_data_parallel_with_full_rank_powersgd_equals_one_rank(comm, overlap):
    """The signature test, compressed: N ranks x batch b == 1 rank x batch N b."""
    model, reference = small_mlp(), small_mlp()
    dp = DataParallel(model, comm, overlap=overlap, compression=exact())
    if comm.size > 1:
        assert_all_ranks(comm, isinstance(dp.transport, PowerSGDTransport)
                         and sum(len(p.matrices) for p in dp.transport.plans) == 3,
                         f"transport {dp.transport.name}")
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = SGD(reference.parameters(), lr=0.1, momentum=0.9)
    data = list(batches("mlp", 6, 48))  # 48 samples: each summed gradient has full rank
    train_parallel(comm, dp, opt, data)
    train_reference(reference, ref_opt, data)
    assert_same_parameters(comm, model, reference, scale=100)
    dp.close()


def test_an_embedding_table_travelling_apart_does_not_hold_back_the_step_count(comm):
    """bow's table is exchanged by rows, outside the transport: its bucket's count stays
    0, and a checkpoint of the minimum restarted the uncompressed steps on resume."""
    model = small_bow()
    dp = DataParallel(model, comm, compression=PowerSGDOptions(start_powerSGD_iter=2))
    opt = SGD(model.parameters(), lr=0.1)
    train_parallel(comm, dp, opt, batches("bow", 3, 12, vocab=500))
    if comm.size > 1:
        t = dp.transport
        assert_all_ranks(comm, len(dp.table_buckets) == 1 and t.step == 3
                         and t.compressing(), f"step {t.step} of {t.steps}")
    dp.close()


def test_parse_and_the_string_form_reach_the_same_transport(comm):
    dp = DataParallel(small_mlp(), comm, compression="powersgd:2")
    if comm.size > 1:
        t = dp.transport
        assert_all_ranks(comm, isinstance(t, PowerSGDTransport)
                         and t.options.matrix_approximation_rank == 2
                         and t.options.start_powerSGD_iter == 1000, t.name)
    dp.close()


RULE = numpy.random.default_rng(3).standard_normal((12, 3))


def classification_task(steps, batch, seed):
    """Twelve features, three classes by a fixed linear rule: learnable, not trivial."""
    rng = numpy.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((batch, 12)).astype(numpy.float32)
        yield x, numpy.argmax(x @ RULE, axis=1)


@pytest.mark.parametrize("rank", [1, 2])
def test_rank_r_powersgd_training_converges(comm, rank):
    """Rank 1 and 2 on a small task: the accuracy on fresh samples is high and close
    to uncompressed training's after the same steps."""
    def train(compression):
        model = mlp(sizes=(12, 32, 32, 3), seed=5, dtype="float32")
        dp = DataParallel(model, comm, compression=compression)
        opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
        train_parallel(comm, dp, opt, classification_task(150, 48, seed=1))
        dp.close()
        x, y = next(classification_task(1, 2000, seed=99))
        logits = model(x)
        accuracy = float((numpy.argmax(logits.data, axis=1) == y).mean())
        return accuracy, float(softmax_cross_entropy(logits, y).data)

    plain_acc, _ = train(None)
    acc, loss = train(PowerSGDOptions(matrix_approximation_rank=rank, start_powerSGD_iter=10))
    assert_all_ranks(comm, acc > 0.85 and acc > plain_acc - 0.05,
                     f"rank {rank}: accuracy {acc:.3f} (uncompressed {plain_acc:.3f}), "
                     f"loss {loss:.3f}")


# -- checkpoints -------------------------------------------------------------------------------

def compressed_run(comm, seed=7):
    """A float32 mlp at rank 1 whose compression starts at the third step."""
    model = mlp(sizes=(12, 16, 16, 3), seed=seed, dtype="float32")
    options = PowerSGDOptions(matrix_approximation_rank=1, start_powerSGD_iter=2,
                              min_compression_rate=0.0)
    dp = DataParallel(model, comm, compression=options)
    return model, dp, SGD(model.parameters(), lr=0.1, momentum=0.9)


def save(comm, directory, model, dp, opt, step):
    return choose_checkpointer(comm, None, dp, model, opt).save(
        directory, step, rng={}, sampler={"epoch": 0, "index": step})


def test_resuming_a_compressed_run_continues_bit_for_bit(comm, shared_dir):
    data = list(batches("mlp", 8, 12, seed=5))
    data = [(x.astype(numpy.float32), y) for x, y in data]
    model, dp, opt = compressed_run(comm)
    train_parallel(comm, dp, opt, data[:4])
    path = save(comm, shared_dir, model, dp, opt, 4)
    train_parallel(comm, dp, opt, data[4:])
    dp.close()
    # Other weights, fresh errors and Qs: everything comes from the checkpoint.
    again, dp2, opt2 = compressed_run(comm, seed=8)
    checkpointer = choose_checkpointer(comm, None, dp2, again, opt2)
    checkpointer.load(ckpt.load_checkpoint(path, "none"))
    if comm.size > 1:
        t = dp2.transport
        assert_all_ranks(comm, t.step == 4 and t.errors[0] is not None,
                         f"step {t.step}, errors {t.errors}")
    train_parallel(comm, dp2, opt2, data[4:])
    differ = [name for (name, p), (_, q) in zip(model.named_parameters(),
                                                again.named_parameters())
              if not numpy.array_equal(p.data, q.data)]
    assert_all_ranks(comm, not differ, f"not bit-identical after resuming: {differ}")
    dp2.close()


def test_without_its_state_the_resumed_run_differs(comm, shared_dir):
    """The test above cannot pass by accident: dropping the errors and Qs changes the
    result (at 2 and more ranks, where PowerSGD runs)."""
    if comm.size == 1:
        pytest.skip("one rank exchanges nothing: no PowerSGD state")
    data = [(x.astype(numpy.float32), y) for x, y in batches("mlp", 8, 12, seed=5)]
    model, dp, opt = compressed_run(comm)
    train_parallel(comm, dp, opt, data[:4])
    path = save(comm, shared_dir, model, dp, opt, 4)
    train_parallel(comm, dp, opt, data[4:])
    dp.close()
    again, dp2, opt2 = compressed_run(comm, seed=8)
    checkpointer = choose_checkpointer(comm, None, dp2, again, opt2)
    checkpointer.compression = None  # as a checkpointer that ignored the state would
    checkpointer.load(ckpt.load_checkpoint(path, "none"))
    dp2.transport.steps = [4] * len(dp2.transport.steps)
    train_parallel(comm, dp2, opt2, data[4:])
    same = all(numpy.array_equal(p.data, q.data) for (_, p), (_, q) in
               zip(model.named_parameters(), again.named_parameters()))
    assert_all_ranks(comm, not same, "the run resumed without PowerSGD's state matched")
    dp2.close()


def test_the_errors_of_all_ranks_reshard_to_one_rank_as_their_sum(comm, shared_dir):
    data = [(x.astype(numpy.float32), y) for x, y in batches("mlp", 4, 12, seed=5)]
    model, dp, opt = compressed_run(comm)
    train_parallel(comm, dp, opt, data)
    path = save(comm, shared_dir, model, dp, opt, 4)
    if comm.size == 1:
        dp.close()
        return  # no exchange, no errors: nothing to reshard
    total = dp.transport.errors[0].astype(numpy.float64)
    comm.allreduce_(total)
    dp.close()
    # Every rank alone: a DataParallel of one rank has no transport state to load
    # into, so the state is loaded into a 1-rank PowerSGD transport directly.
    from mpidl.comm import SingleCommunicator
    from mpidl.parallel.powersgd import PowerSGDTransport
    from mpidl.parallel.powersgd_state import PowerSGDState
    from mpidl.train.pieces import load as load_pieces
    from mpidl.train.sharded import ShardedSource

    shapes = [[tuple(p.data.shape) for p in b.params] for b in dp.buckets]
    names = {id(p): n for n, p in model.named_parameters()}
    one = PowerSGDTransport(SingleCommunicator(), 1 << 22, dp.transport.options, shapes)
    one.bind([numpy.zeros_like(b.flat) for b in dp.buckets])
    state = PowerSGDState(one, [[names[id(p)] for p in b.params] for b in dp.buckets])
    source = ShardedSource(path, ckpt.load_checkpoint(path, "none").index)
    try:
        state.load(source, load_pieces)
    finally:
        source.close()
    got = one.errors[0]
    for k in one.plans[0].matrices:  # only the matrices' errors are kept
        part = slice(k.start, k.start + k.n * k.m)
        assert_allclose_all_ranks(comm, got[part], total[part].astype(numpy.float32),
                                  what=f"member {k.index}")
    assert_all_ranks(comm, one.step == 4, f"step {one.step}")
