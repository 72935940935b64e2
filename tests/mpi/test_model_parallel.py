"""The GPT on a process grid == the single-rank GPT, forward, backward and after steps.

Every layout uses all the ranks (tensor = size, sequence = size, or a 2-D grid when the
size allows it: 2 x 2 at 4 ranks). Each rank also trains the single-rank model on the
whole global batch, in float64, and compares the loss, the logits and the full
(gathered) gradients of the first step, then the full parameters after several AdamW
steps. The vocabulary (13), the hidden width and the number of targets (7) do not
divide 2, 3 or 4 ranks: uneven shards and layout padding are on every path.
"""
from __future__ import annotations

import numpy
import pytest

from mpidl import functions as F
from mpidl.comm import split_counts
from mpidl.models import gpt
from mpidl.optim import AdamW
from mpidl.parallel import DataParallel, ProcessGrid, parallel_gpt
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks, raises_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

VOCAB, TARGETS, STEPS = 13, 7, 3


def even(n, k=2):
    """``k`` when it divides ``n`` (a real 2-D grid), else 1."""
    return k if n % k == 0 and n > k - 1 else 1


# name -> (tensor, sequence, options) as a function of the world size
LAYOUTS = {
    "tensor": lambda n: (n, 1, {}),
    "tensor-sequence-parallel": lambda n: (n, 1, {"sequence_parallel": True}),
    "ulysses": lambda n: (1, n, {"attention": "ulysses"}),
    "ring": lambda n: (1, n, {"attention": "ring"}),
    "data-x-tensor": lambda n: (even(n), 1, {}),
    "data-x-tensor-sequence-parallel": lambda n: (even(n), 1, {"sequence_parallel": True}),
    "data-x-ring": lambda n: (1, even(n), {"attention": "ring"}),
    "data-x-ulysses": lambda n: (1, even(n), {"attention": "ulysses"}),
    "tensor-x-ring": lambda n: (even(n), n // even(n), {"attention": "ring"}),
    "tensor-x-ulysses": lambda n: (even(n), n // even(n), {"attention": "ulysses"}),
    "tensor-sequence-parallel-x-ring": lambda n: (even(n), n // even(n),
                                                  {"attention": "ring",
                                                   "sequence_parallel": True}),
}


def config(tensor, sequence, **extra):
    heads = 2 * tensor * sequence  # Ulysses: every tensor rank's heads divisible by sequence
    kw = dict(vocab=VOCAB, seq_len=12, dim=2 * heads, layers=2, heads=heads, ffn=4 * heads + 1,
              seed=5, dtype="float64")
    kw.update(extra)
    return kw


def batches(global_batch, pad_id=None, seed=0):
    rng = numpy.random.default_rng(seed)
    for _ in range(STEPS):
        ids = rng.integers(1, VOCAB, size=(global_batch, TARGETS + 1))
        if pad_id is not None:  # right padding of different lengths
            for row, keep in enumerate(rng.integers(2, TARGETS + 1, size=global_batch)):
                ids[row, keep:] = pad_id
        yield ids


def data_share(grid, ids):
    counts = split_counts(len(ids), grid.data_size)
    start = sum(counts[:grid.data_rank])
    return ids[start:start + counts[grid.data_rank]]


def full_grads(model):
    return {name: p.shard.gather(p.grad) if hasattr(p, "shard") else p.grad
            for name, p in model.named_parameters()}


def check_exact(comm, layout, pad_id=None, dropout=0.0, scale=100):
    tensor, sequence, options = LAYOUTS[layout](comm.size)
    grid = ProcessGrid(comm, tensor=tensor, sequence=sequence)
    kw = config(tensor, sequence, pad_id=pad_id, dropout=dropout)
    reference, model = gpt(**kw), parallel_gpt(grid, **options, **kw)
    dp = DataParallel(model, grid.replicas)
    ref_opt = AdamW(reference.parameters(), lr=0.02, weight_decay=0.01)
    opt = AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    try:
        for step, ids in enumerate(batches(2 * grid.data_size, pad_id)):
            n = reference.count_targets(ids)
            ref_loss = reference.loss(ids, reduction="sum")
            F.mul(ref_loss, 1.0 / n).backward()
            mine = data_share(grid, ids)
            loss = model.loss(mine, reduction="sum")
            dp.backward(loss, global_count=n)
            if step == 0:
                total = grid.replicas.allreduce(numpy.asarray(loss.data))
                assert_allclose_all_ranks(comm, total, ref_loss.data, what=f"{layout}: loss")
                if dropout == 0.0:
                    logits = model.gather_logits(model(mine[:, :-1]), TARGETS)
                    start = sum(split_counts(len(ids), grid.data_size)[:grid.data_rank])
                    expected = reference(ids[start:start + len(mine), :-1]).data
                    assert_allclose_all_ranks(comm, logits, expected, what=f"{layout}: logits")
                grads = full_grads(model)
                for name, p in reference.named_parameters():
                    assert_allclose_all_ranks(comm, grads[name], p.grad, scale=10,
                                              what=f"{layout}: grad {name}")
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad()
            opt.zero_grad()
        state = model.full_state_dict()
        for name, p in reference.named_parameters():
            assert_allclose_all_ranks(comm, state[name], p.data, scale=scale,
                                      what=f"{layout}: {name} after {STEPS} steps")
    finally:
        dp.close()
        grid.free()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_gpt_trains_like_the_single_rank_gpt(comm, layout):
    check_exact(comm, layout)


@pytest.mark.parametrize("layout", ["tensor-sequence-parallel", "ring", "ulysses"])
def test_padding_in_the_data_gives_no_loss_on_any_layout(comm, layout):
    check_exact(comm, layout, pad_id=0)


@pytest.mark.parametrize("layout", ["tensor-sequence-parallel", "ring", "tensor-x-ring"])
def test_dropout_masks_are_the_single_rank_models_on_every_shard(comm, layout):
    check_exact(comm, layout, dropout=0.2)


def test_untied_output_projection_is_split_like_the_vocabulary(comm):
    grid = ProcessGrid(comm, tensor=comm.size)
    kw = config(comm.size, 1, tie_weights=False)
    reference, model = gpt(**kw), parallel_gpt(grid, sequence_parallel=True, **kw)
    ids = next(batches(2))
    ref = reference.loss(ids)
    loss = model.loss(ids)
    ref.backward()
    loss.backward()
    assert_allclose_all_ranks(comm, loss.data, ref.data, what="loss")
    grads = full_grads(model)
    for name, p in reference.named_parameters():
        assert_allclose_all_ranks(comm, grads[name], p.grad, scale=10, what=name)
    grid.free()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, 2])
def test_vocab_parallel_cross_entropy_equals_the_full_logits_loss_on_every_rank(
        comm, reduction, ignore_index):
    # 11 classes split over the ranks unevenly (6+5, 4+4+3): each rank's loss and its
    # slice of the gradient are those of softmax_cross_entropy on the full logits.
    from mpidl.autograd import Tensor
    from mpidl.parallel.vocab import vocab_parallel_cross_entropy

    rng = numpy.random.default_rng(2)
    vocab = 11
    logits, labels = 3 * rng.standard_normal((3, 5, vocab)), rng.integers(0, vocab, (3, 5))
    counts = split_counts(vocab, comm.size)
    start = sum(counts[:comm.rank])
    mine = Tensor(logits[..., start:start + counts[comm.rank]].copy(), requires_grad=True)
    full = Tensor(logits, requires_grad=True)
    got = vocab_parallel_cross_entropy(mine, labels, comm, start, vocab,
                                       ignore_index=ignore_index, reduction=reduction)
    want = F.softmax_cross_entropy(full, labels, ignore_index=ignore_index, reduction=reduction)
    weights = rng.standard_normal(want.shape)  # a gradient that differs per element
    F.sum(F.mul(got, weights)).backward()
    F.sum(F.mul(want, weights)).backward()
    assert_allclose_all_ranks(comm, got.data, want.data, what=f"{reduction} loss")
    assert_allclose_all_ranks(comm, mine.grad, full.grad[..., start:start + counts[comm.rank]],
                              what=f"{reduction} gradient of this rank's classes")


def test_vocab_parallel_cross_entropy_of_float16_logits_works_in_float32(comm):
    # MPI has no float16 max everywhere: 16-bit logits are reduced in float32, the
    # gradient comes back in float16 and the loss stays float32 (as softmax_cross_entropy's
    # of 16-bit logits: a 16-bit batch loss sum keeps 8-11 bits), close to the float32
    # loss of the same logits.
    from mpidl.autograd import Tensor
    from mpidl.parallel.vocab import vocab_parallel_cross_entropy

    rng = numpy.random.default_rng(3)
    vocab = 11
    logits = (3 * rng.standard_normal((6, vocab))).astype(numpy.float16)
    labels = rng.integers(0, vocab, 6)
    counts = split_counts(vocab, comm.size)
    start = sum(counts[:comm.rank])
    mine = Tensor(logits[:, start:start + counts[comm.rank]].copy(), requires_grad=True)
    full = Tensor(logits.astype(numpy.float32), requires_grad=True)
    got = vocab_parallel_cross_entropy(mine, labels, comm, start, vocab)
    want = F.softmax_cross_entropy(full, labels)
    got.backward()
    want.backward()
    ok = got.data.dtype == numpy.float32 and mine.grad.dtype == numpy.float16
    assert_all_ranks(comm, ok, f"loss {got.data.dtype}, gradient {mine.grad.dtype}")
    assert_allclose_all_ranks(comm, got.data, want.data, dtype="float16", what="loss")
    assert_allclose_all_ranks(comm, mine.grad, full.grad[:, start:start + counts[comm.rank]],
                              dtype="float16", what="gradient")
    from mpidl.parallel.vocab import vocab_parallel_hits

    hits = vocab_parallel_hits(mine, labels, comm, start)
    want_hits = int((logits.argmax(axis=1) == labels).sum())
    assert_all_ranks(comm, hits == want_hits, f"{hits} float16 hits, {want_hits} by argmax")


def test_vocab_parallel_hits_are_the_full_logits_argmax_hits_ties_included(comm):
    from mpidl.parallel.vocab import vocab_parallel_hits

    rng = numpy.random.default_rng(0)
    vocab, n = max(7, comm.size), 40  # a column or more on every rank, at any size
    logits = rng.integers(0, 3, size=(n, vocab)).astype(numpy.float64)  # ties in most rows
    labels = rng.integers(0, vocab, size=n)
    labels[1::4] = logits.argmax(axis=1)[1::4]  # hits at any vocabulary size
    labels[::5] = -1  # ignored
    counts = split_counts(vocab, comm.size)
    start = sum(counts[:comm.rank])
    mine = logits[:, start:start + counts[comm.rank]].reshape(4, 10, -1)
    got = vocab_parallel_hits(mine, labels.reshape(4, 10), comm, start, ignore_index=-1)
    want = int(((logits.argmax(axis=1) == labels) & (labels != -1)).sum())  # first maximum
    assert_all_ranks(comm, got == want and 0 < want < n,
                     f"{got} hits over the split vocabulary; the full logits give {want}")


def test_a_grid_that_does_not_divide_the_world_is_an_error_on_every_rank(comm):
    with raises_all_ranks(comm, ValueError, match="does not divide"):
        ProcessGrid(comm, tensor=comm.size + 1)


def test_grid_sizes_that_differ_between_ranks_are_named(comm):
    from mpidl.comm import DistributedError

    if comm.size == 1:
        pytest.skip("one rank cannot disagree with itself")
    with raises_all_ranks(comm, DistributedError, match="sizes differ"):
        ProcessGrid(comm, tensor=1 if comm.rank else comm.size)


def test_grid_axes_hold_the_ranks_their_coordinates_say(comm):
    t, s = even(comm.size), 1
    grid = ProcessGrid(comm, tensor=t, sequence=s)
    world = comm.allgather_obj(grid.coordinates)
    members = {name: getattr(grid, name).allgather_obj(comm.rank)
               for name in ("tensor", "sequence", "data", "replicas")}
    d, q, r = grid.coordinates
    ok = (grid.world_rank(d, q, r) == comm.rank
          and members["tensor"] == [grid.world_rank(d, q, i) for i in range(t)]
          and members["data"] == [grid.world_rank(i, q, r) for i in range(grid.data_size)]
          and members["replicas"] == [c for c in range(comm.size) if world[c][2] == r])
    assert_all_ranks(comm, ok, f"{grid}: {members}")
    grid.free()


def test_ulysses_with_heads_the_sequence_group_does_not_divide_is_refused(comm):
    if comm.size == 1:
        pytest.skip("one rank divides every head count")
    grid = ProcessGrid(comm, sequence=comm.size)
    with raises_all_ranks(comm, ValueError, match="does not divide"):
        kw = config(1, 1, heads=comm.size + 1, dim=comm.size + 1)
        parallel_gpt(grid, attention="ulysses", **kw)
    grid.free()
