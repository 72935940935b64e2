"""What tensor and sequence parallelism cost and save: bytes per layer against the
formulas of docs/model-parallel.md, activation memory per rank, and checkpoints that
move between layouts.

Traffic per layer is the difference between a 2-layer and a 1-layer model's traffic
in one forward and backward (embedding, head and loss cancel out), counted by a
:class:`~mpidl.testing.counting.CountingCommunicator` under the grid.
"""
from __future__ import annotations

import math

import numpy
import pytest

from mpidl import functions as F
from mpidl.comm import split_counts
from mpidl.models import gpt
from mpidl.optim import AdamW
from mpidl.parallel import DataParallel, ProcessGrid, parallel_gpt
from mpidl.parallel.ring import ring_attention
from mpidl.parallel.sequence import SequenceLayout, ulysses_attention
from mpidl.parallel.tensor import (clip_grad_norm_, full_optimizer_state,
                                   load_full_optimizer_state)
from mpidl.autograd import Tensor
from mpidl.nn.attention import merge_heads, split_heads
from mpidl.optim.clip import grad_norm as single_grad_norm
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks
from mpidl.testing.counting import CountingCommunicator
from mpidl.testing.memory import peak_bytes

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

B, T, VOCAB, F8 = 2, 12, 11, 8  # T divides 1..4 ranks; float64 bytes


def heads_and_width(size):
    """4 heads of width 2, or a head per rank where there are more ranks (the many-rank
    tier's 8 and 16): every tensor-parallel rank needs a head."""
    heads = max(4, size)
    return heads, 2 * heads


def kwargs(layers, heads, dim, **extra):
    kw = dict(vocab=VOCAB, seq_len=16, dim=dim, layers=layers, heads=heads, ffn=3 * dim,
              seed=2, dtype="float64")
    kw.update(extra)
    return kw


def traffic(comm, layers, tensor, sequence, options, dim, heads):
    """Bytes and calls per axis and op: (forward, backward) of one loss on one batch."""
    world = CountingCommunicator(comm)
    grid = ProcessGrid(world, tensor=tensor, sequence=sequence)
    model = parallel_gpt(grid, **options, **kwargs(layers, heads, dim))
    ids = numpy.random.default_rng(0).integers(0, VOCAB, (B, T + 1))
    axes = {"tensor": grid.tensor, "sequence": grid.sequence}
    for c in axes.values():
        c.reset()
    loss = model.loss(ids)
    forward = {a: dict(c.counts) for a, c in axes.items()}
    for c in axes.values():
        c.reset()
    loss.backward()
    backward = {a: dict(c.counts) for a, c in axes.items()}
    grid.free()
    return forward, backward


def per_layer(comm, tensor, sequence, options, dim=8, heads=4):
    """``{(pass, axis, op): (calls, bytes)}`` that one more layer adds."""
    one = traffic(comm, 1, tensor, sequence, options, dim, heads)
    two = traffic(comm, 2, tensor, sequence, options, dim, heads)
    out = {}
    for i, name in enumerate(("forward", "backward")):
        for axis in two[i]:
            for op, c in two[i][axis].items():
                base = one[i][axis].get(op)
                calls, nbytes = c.calls - (base.calls if base else 0), \
                    c.nbytes - (base.nbytes if base else 0)
                if calls or nbytes:
                    out[(name, axis, op)] = (calls, nbytes)
    return out


def expect(comm, got, want, label):
    assert_all_ranks(comm, got == want, f"{label}: per-layer traffic {got} != theory {want}")


def test_tensor_parallel_sends_two_allreduces_of_btd_per_layer_each_way(comm):
    t, (heads, d) = comm.size, heads_and_width(comm.size)
    got = per_layer(comm, t, 1, {}, dim=d, heads=heads)
    btd = B * T * d * F8
    want = {} if t == 1 else {("forward", "tensor", "allreduce_"): (2, 2 * btd),
                              ("backward", "tensor", "allreduce_"): (2, 2 * btd)}
    expect(comm, got, want, "tensor parallel")


def test_megatron_sequence_parallelism_swaps_each_allreduce_for_gathers_and_a_scatter(comm):
    t, (heads, d) = comm.size, heads_and_width(comm.size)
    if T % t:
        pytest.skip(f"the theory below is for T={T} in equal shards, not over {t} ranks")
    got = per_layer(comm, t, 1, {"sequence_parallel": True}, dim=d, heads=heads)
    btd = B * T * d * F8
    shard = btd // t
    # Backward gathers the two column-parallel inputs again (they are stored as shards),
    # and sums the replicated LayerNorm weights and biases and the row-parallel biases
    # over the group: 6 vectors of D per layer.
    want = {} if t == 1 else {
        ("forward", "tensor", "allgather"): (2, 2 * shard),
        ("forward", "tensor", "reduce_scatter"): (2, 2 * btd),
        ("backward", "tensor", "allgather"): (4, 4 * shard),
        ("backward", "tensor", "reduce_scatter"): (2, 2 * btd),
        ("backward", "tensor", "allreduce_"): (6, 6 * d * F8)}
    expect(comm, got, want, "Megatron sequence parallel")


def test_ulysses_sends_four_all_to_alls_of_btd_over_s_per_layer_each_way(comm):
    s, heads = comm.size, 2 * comm.size
    d = 2 * heads
    got = per_layer(comm, 1, s, {"attention": "ulysses"}, dim=d, heads=heads)
    btd_s = B * -(-T // s) * d * F8  # T / s tokens a rank, padded up where s does not divide
    want = {} if s == 1 else {("forward", "sequence", "alltoall"): (2, 4 * btd_s),
                              ("backward", "sequence", "alltoall"): (2, 4 * btd_s)}
    expect(comm, got, want, "Ulysses")


def test_ring_passes_s_minus_1_kv_blocks_forward_and_the_kv_gradients_back(comm):
    s, d = comm.size, 8
    got = per_layer(comm, 1, s, {"attention": "ring"}, dim=d)
    # K and V of this rank's tokens, all heads; the zigzag layout pads T to 2s chunks.
    kv = 2 * B * SequenceLayout(T, s, zigzag=True).shard_length * d * F8
    want = {} if s == 1 else {("forward", "sequence", "isendrecv"): (s - 1, (s - 1) * kv),
                              ("backward", "sequence", "isendrecv"): (2 * s - 1,
                                                                      (2 * s - 1) * kv)}
    expect(comm, got, want, "ring")


# -- memory ----------------------------------------------------------------------------------
def attention_peak(comm, s, mode, length=192, heads=12, dh=4):
    """Peak bytes of one attention forward and backward per rank, sequence group of ``s``."""
    grid = ProcessGrid(comm, sequence=s)
    seq = grid.sequence
    rng = numpy.random.default_rng(0)
    layout = SequenceLayout(length, s, seq.rank, zigzag=(mode == "ring"))
    qkv = layout.split(rng.standard_normal((1, length, 3 * heads * dh)).astype("float32"))

    def run():
        x = Tensor(qkv, requires_grad=True)
        if mode == "ring":
            y = merge_heads(ring_attention(*split_heads(x, heads), seq, layout, causal=True))
        else:
            y = ulysses_attention(x, seq, heads, True, layout)
        F.sum(y).backward()

    _, peak = peak_bytes(run)
    grid.free()
    return peak


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_attention_activation_bytes_per_rank_shrink_with_the_sequence_group(comm, mode):
    sizes = [s for s in range(1, comm.size + 1) if comm.size % s == 0]
    if mode == "ulysses":  # its 12 heads split evenly
        sizes = [s for s in sizes if 12 % s == 0]
    peaks = {s: max(comm.allgather_obj(attention_peak(comm, s, mode))) for s in sizes}
    # The T x T scores per head dominate here: Ulysses keeps H/s heads of the whole
    # sequence (1/s, and all-to-all buffers), the ring blocks of (T/s)^2 (less than 1/s).
    ok = all(peaks[s] <= 1.15 * peaks[1] / s for s in sizes)
    assert_all_ranks(comm, ok, f"{mode}: peak bytes per rank by group size {peaks}")


def train_step_peak(model, ids):
    """Peak bytes of one forward and backward of ``model.loss(ids)`` (gradients exist)."""
    model.loss(ids).backward()  # the gradient arrays exist from here on, as in training
    for p in model.parameters():
        p.grad[...] = 0
    return peak_bytes(lambda: model.loss(ids).backward())[1]


def test_ring_attention_at_3_ranks_trains_sequences_2_5_times_longer_in_one_budget(comm):
    if comm.size < 3:
        pytest.skip("needs a sequence group of at least 3 ranks")
    kw = dict(vocab=32, seq_len=256, dim=16, layers=2, heads=4, seed=1, dtype="float32")
    short, long = 96, 240  # 2.5x
    rng = numpy.random.default_rng(0)
    budget = train_step_peak(gpt(**kw), rng.integers(0, 32, (1, short + 1)))
    over = train_step_peak(gpt(**kw), rng.integers(0, 32, (1, short + 2)))
    grid = ProcessGrid(comm, sequence=comm.size)
    model = parallel_gpt(grid, attention="ring", **kw)
    ids = rng.integers(0, 32, (1, long + 1))
    used = comm.allgather_obj(train_step_peak(model, ids))
    opt = AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):  # and it trains: the same sequence, the loss goes down
        opt.zero_grad()
        loss = model.loss(ids)
        loss.backward()
        for p in model.parameters():  # the sequence group's shares of each gradient
            grid.replicas.allreduce_(p.grad)
        opt.step()
        losses.append(float(grid.sequence.allreduce(numpy.asarray(loss.data))))
    grid.free()
    ok = over > budget and max(used) <= budget and losses[-1] < losses[0]
    assert_all_ranks(comm, ok, f"1 rank: {budget} B at T={short} ({over} at T={short + 1}); "
                               f"ring over {comm.size} at T={long}: {used}; losses {losses}")


# -- checkpoints across layouts --------------------------------------------------------------
def divisors(n):
    return [t for t in range(1, n + 1) if n % t == 0]


def test_a_tensor_parallel_checkpoint_resumes_at_every_other_layout(comm, tmp_path_factory):
    from mpidl.train.checkpoint import load_checkpoint, save_checkpoint

    kw = kwargs(2, *heads_and_width(comm.size))
    ids = [numpy.random.default_rng(i).integers(0, VOCAB, (2, T + 1)) for i in range(4)]

    def train(model, grid, batches, opt=None, optimizer_state=None):
        opt = opt or AdamW(model.parameters(), lr=0.01)
        if optimizer_state is not None:
            load_full_optimizer_state(opt, model, optimizer_state)
        dp = DataParallel(model, grid.replicas, broadcast=False)
        for batch in batches:
            counts = split_counts(len(batch), grid.data_size)
            start = sum(counts[:grid.data_rank])
            mine = batch[start:start + counts[grid.data_rank]]
            dp.backward(model.loss(mine), global_count=model.count_targets(batch))
            opt.step()
            opt.zero_grad()
        dp.close()
        return opt

    grid = ProcessGrid(comm, tensor=comm.size)
    model = parallel_gpt(grid, **kw)
    opt = train(model, grid, ids[:2])
    state, optim = model.full_state_dict(), full_optimizer_state(opt, model)
    path = comm.bcast_obj(str(tmp_path_factory.mktemp("ckpt")) if comm.rank == 0 else None)
    if comm.rank == 0:
        save_checkpoint(path, 2, model=state, optimizer=optim, rng={}, sampler={})
    comm.barrier()
    train(model, grid, ids[2:], opt)  # the run goes on at its own layout: the expectation
    expected = {k: v.copy() for k, v in model.full_state_dict().items()}
    grid.free()
    saved = load_checkpoint(f"{path}/checkpoint-00000002.h5")
    for t in divisors(comm.size):
        for sp in (False, True):
            other = ProcessGrid(comm, tensor=t)
            resumed = parallel_gpt(other, sequence_parallel=sp, **kw)
            resumed.load_full_state_dict(saved.model)
            train(resumed, other, ids[2:], optimizer_state=saved.optimizer)
            got = resumed.full_state_dict()
            for name, value in expected.items():
                assert_allclose_all_ranks(comm, got[name], value, scale=100,
                                          what=f"tensor={t} sequence_parallel={sp}: {name}")
            other.free()


def test_the_gradient_norm_counts_every_shard_once(comm):
    grid = ProcessGrid(comm, tensor=comm.size)
    kw = kwargs(1, *heads_and_width(comm.size))
    reference, model = gpt(**kw), parallel_gpt(grid, **kw)
    ids = numpy.random.default_rng(3).integers(0, VOCAB, (2, T + 1))
    reference.loss(ids).backward()
    model.loss(ids).backward()
    expected = float(single_grad_norm(reference.parameters()))
    norm = clip_grad_norm_(model.parameters(), max_norm=expected / 2, comm=grid.tensor)
    clipped = math.sqrt(sum(float(numpy.sum(g * g)) for g in
                            [p.shard.gather(p.grad) if hasattr(p, "shard") else p.grad
                             for p in model.parameters()]))
    assert_allclose_all_ranks(comm, numpy.array([float(norm), clipped]),
                              numpy.array([expected, expected / 2]), scale=1e5,
                              what="norm before and after clipping")
    grid.free()
