"""ZeRO's contracts that only show on several ranks or several steps.

Each test here closes a gap a mutation run found (issue #31): a plausible mistake in
``mpidl/parallel/zero.py`` that every other test let pass. The default contract without
``global_count``, a parameter some rank's batch never reaches, the memory each stage
promises (under ``no_sync`` too), clipping that really clips, the checkpoint pieces of
every rank, and the buffers a full state restores. float64, exact against one rank.
"""
from __future__ import annotations

import numpy
import pytest

import mpidl.functions as F
from mpidl.functions import softmax_cross_entropy
from mpidl.models import mlp
from mpidl.nn import Linear, Module
from mpidl.optim import SGD, AdamW, clip_grad_norm_
from mpidl.parallel import ShardedDataParallel
from mpidl.parallel.zero_state import load_full_state, pieces_to_full, state_pieces
from mpidl.testing import allclose, assert_all_ranks, assert_allclose_all_ranks
from mpidl.testing.models import TwoHeads, full_parameters

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

STAGES = [1, 2, 3]
PER_RANK = 4


def small_mlp():
    # 7*11 + 11 + 11*5 + 5 = 148 parameters: not a multiple of 2 or 3 (blocks are padded)
    return mlp(sizes=(7, 11, 5), seed=4, dtype="float64")


def global_batches(comm, steps, seed=1):
    """The same global batches on every rank: PER_RANK samples for each rank."""
    rng = numpy.random.default_rng(seed)
    n = PER_RANK * comm.size
    return [(rng.standard_normal((n, 7)), rng.integers(0, 5, size=n)) for _ in range(steps)]


def mine(comm, a):
    return a[PER_RANK * comm.rank:PER_RANK * (comm.rank + 1)]


def reference_step(opt, loss):
    """One optimizer step of the single-rank reference on ``loss``."""
    loss.backward()
    opt.step()
    opt.zero_grad()


def assert_same_as(comm, sdp, reference, what):
    got = full_parameters(sdp)
    for name, q in reference.named_parameters():
        assert_allclose_all_ranks(comm, got[name], q.data, scale=10.0, what=f"{what}: {name}")


# -- the default contract: no global_count ------------------------------------------------

@pytest.mark.parametrize("stage", STAGES)
def test_backward_without_global_count_averages_the_ranks_mean_losses(comm, stage):
    # DataParallel's documented default: each rank's loss is its own mean, and the
    # gradient is the mean of the ranks' gradients. Equal shares: the global batch mean.
    model, ref = small_mlp(), small_mlp()
    sdp = ShardedDataParallel(model, comm, stage=stage)
    opt, ref_opt = SGD(sdp.parameters(), lr=0.5), SGD(ref.parameters(), lr=0.5)
    for x, y in global_batches(comm, steps=2):
        sdp.backward(softmax_cross_entropy(sdp(mine(comm, x)), mine(comm, y)))
        opt.step()
        opt.zero_grad()
        reference_step(ref_opt, softmax_cross_entropy(ref(x), y))
    assert_same_as(comm, sdp, ref, f"stage {stage}")
    sdp.close()


@pytest.mark.parametrize("stage", STAGES)
def test_accumulating_without_global_count_equals_one_big_batch(comm, stage):
    # Two micro-batches, each loss the mean of its half over 2: the accumulated gradient
    # is DataParallel's (1/N) sum over ranks and micro-batches. Stages 2-3 reduce every
    # micro-batch into the shards, so each block is scaled once, not the sum so far again.
    model, ref = small_mlp(), small_mlp()
    sdp = ShardedDataParallel(model, comm, stage=stage)
    opt, ref_opt = SGD(sdp.parameters(), lr=0.5), SGD(ref.parameters(), lr=0.5)
    half = PER_RANK // 2
    for x, y in global_batches(comm, steps=2):
        xs, ys = mine(comm, x), mine(comm, y)
        with sdp.no_sync():
            sdp.backward(F.mul(softmax_cross_entropy(sdp(xs[:half]), ys[:half]), 0.5))
        sdp.backward(F.mul(softmax_cross_entropy(sdp(xs[half:]), ys[half:]), 0.5))
        opt.step()
        opt.zero_grad()
        reference_step(ref_opt, softmax_cross_entropy(ref(x), y))
    assert_same_as(comm, sdp, ref, f"stage {stage}")
    sdp.close()


# -- a parameter this rank's batch did not reach ------------------------------------------

def every_ranks_loss(ref, size, use_b):
    """The single-rank reference's loss over every rank's batch (rank r's: 2 rows of
    r + 1, head b used where ``use_b(r)``), averaged over the 2 * size rows."""
    total = None
    for r in range(size):
        out = F.sum(ref(numpy.full((2, 4), r + 1.0), use_b(r)))
        total = out if total is None else F.add(total, out)
    return F.mul(total, 1.0 / (2 * size))


def reaches_b(rank, step):
    # Every rank's batch reaches head b in step 0; in step 1 only odd ranks' do (at one
    # rank: none), so b's gradient slot still holds step 0's values on the others.
    return step == 0 or rank % 2 == 1


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_the_batch_did_not_reach_sums_zeros_not_the_last_steps_gradient(
        comm, stage):
    sdp = ShardedDataParallel(TwoHeads(), comm, stage=stage)
    ref = TwoHeads()
    opt, ref_opt = SGD(sdp.parameters(), lr=1.0), SGD(ref.parameters(), lr=1.0)
    n = 2 * comm.size
    for step in range(2):
        x = numpy.full((2, 4), comm.rank + 1.0)
        sdp.backward(F.sum(sdp(x, reaches_b(comm.rank, step))), global_count=n)
        opt.step()
        opt.zero_grad()
        reference_step(ref_opt, every_ranks_loss(ref, comm.size, lambda r: reaches_b(r, step)))
        assert_same_as(comm, sdp, ref, f"stage {stage}, step {step}")
    sdp.close()


# -- what each stage holds ----------------------------------------------------------------

def expected_bytes(sdp, stage, synced):
    """What a rank holds after backward (and, when ``synced``, an AdamW step): stage 1
    the full parameters and gradient buffer (plus the reduced gradient block), stage 2
    the full parameters and only gradient blocks, stage 3 blocks only. Without a sync
    (``no_sync``) stage 1 holds the full gradient only; stages 2-3 still reduce into
    their blocks."""
    full = sum(u.padded for u in sdp.units) * 8  # float64, padded to N blocks
    block = sum(u.block for u in sdp.units) * 8
    params = block if stage == 3 else full
    if stage == 1:
        grads = full + block if synced else full
    else:
        grads = block
    return {"parameters": params, "gradients": grads, "optimizer": 2 * block if synced else 0}


@pytest.mark.parametrize("synced", [True, False], ids=["step", "no_sync"])
@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_holds_exactly_its_promised_share_of_the_state(comm, stage, synced):
    sdp = ShardedDataParallel(small_mlp(), comm, stage=stage)
    opt = AdamW(sdp.parameters(), lr=1e-2)
    x, y = global_batches(comm, steps=1)[0]
    loss = softmax_cross_entropy(sdp(mine(comm, x)), mine(comm, y), reduction="sum")
    if synced:
        sdp.backward(loss, global_count=len(x))
        opt.step()
    else:
        with sdp.no_sync():
            sdp.backward(loss, global_count=len(x))
    held, want = sdp.state_bytes(opt), expected_bytes(sdp, stage, synced)
    sdp.close()
    assert_all_ranks(comm, held == want, f"stage {stage} holds {held}, promised {want}")


# -- clipping ------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", STAGES)
def test_clipping_scales_the_shards_to_the_global_norm_as_one_rank_does(comm, stage):
    max_norm = 0.05  # the gradients' norm here is 0.3-0.5: every step clips
    model, ref = small_mlp(), small_mlp()
    sdp = ShardedDataParallel(model, comm, stage=stage)
    opt = SGD(sdp.parameters(), lr=0.5, momentum=0.9)
    ref_opt = SGD(ref.parameters(), lr=0.5, momentum=0.9)
    norms, after = [], []
    for x, y in global_batches(comm, steps=3):
        loss = softmax_cross_entropy(sdp(mine(comm, x)), mine(comm, y), reduction="sum")
        sdp.backward(loss, global_count=len(x))
        norms.append(sdp.clip_grad_norm_(max_norm))
        after.append(sdp.grad_norm())
        opt.step()
        opt.zero_grad()
        softmax_cross_entropy(ref(x), y).backward()
        want = float(clip_grad_norm_(ref.parameters(), max_norm))
        ref_opt.step()
        ref_opt.zero_grad()
        assert_allclose_all_ranks(comm, numpy.float64(norms[-1]), numpy.float64(want),
                                  what="the norm before clipping")
    clipped = all(n > 2 * max_norm for n in norms) and \
        allclose(numpy.array(after), numpy.full(len(after), max_norm), dtype="float32")
    assert_all_ranks(comm, clipped, f"norms {norms} before and {after} after clipping at "
                                    f"{max_norm}: clipping must have happened, to the bound")
    assert_same_as(comm, sdp, ref, f"stage {stage}")
    sdp.close()


# -- checkpoint pieces and full state ------------------------------------------------------

@pytest.mark.parametrize("stage", STAGES)
def test_every_ranks_checkpoint_pieces_assemble_into_the_single_rank_state(comm, stage):
    model, ref = small_mlp(), small_mlp()
    sdp = ShardedDataParallel(model, comm, stage=stage, bucket_mb=0.0005)  # several units
    opt, ref_opt = AdamW(sdp.parameters(), lr=1e-2), AdamW(ref.parameters(), lr=1e-2)
    for x, y in global_batches(comm, steps=2):
        loss = softmax_cross_entropy(sdp(mine(comm, x)), mine(comm, y), reduction="sum")
        sdp.backward(loss, global_count=len(x))
        opt.step()
        opt.zero_grad()
        reference_step(ref_opt, softmax_cross_entropy(ref(x), y))
    pieces = comm.allgather_obj(state_pieces(sdp, opt))  # small: a test model
    order = [n for n, _ in sdp.named]
    full_model, full_opt = pieces_to_full([m for m, _ in pieces], [o for _, o in pieces], order)
    sdp.close()
    for name, q in ref.named_parameters():
        assert_allclose_all_ranks(comm, full_model[name], q.data, scale=10.0, what=name)
    want = ref_opt.state_dict()
    arrays = sorted(k for k in want if hasattr(want[k], "shape"))
    assert_all_ranks(comm, sorted(k for k in full_opt if hasattr(full_opt[k], "shape"))
                     == arrays, f"optimizer arrays {sorted(full_opt)} != {sorted(want)}")
    for key in arrays:
        assert_allclose_all_ranks(comm, full_opt[key], want[key], scale=10.0, what=key)


class WithBuffer(Module):
    def __init__(self):
        super().__init__()
        self.lin = Linear(4, 3, seed=1, dtype="float64")
        self.register_buffer("running", numpy.zeros(3))


@pytest.mark.parametrize("stage", STAGES)
def test_loading_a_full_state_restores_the_buffers_and_every_shard(comm, stage):
    source = WithBuffer()
    source.lin.weight.data[...] += 1.0
    state = {n: p.data.copy() for n, p in source.named_parameters()}
    state["running"] = numpy.array([0.5, -1.5, 2.0])
    target = WithBuffer()
    sdp = ShardedDataParallel(target, comm, stage=stage)
    opt = AdamW(sdp.parameters(), lr=1e-2)
    load_full_state(sdp, state, None, opt)
    assert_allclose_all_ranks(comm, target.running, state["running"], what="buffer")
    got = full_parameters(sdp)
    for name, value in state.items():
        if name != "running":
            assert_allclose_all_ranks(comm, got[name], value, what=name)
    sdp.close()


# -- buffers that ranks would let drift apart -----------------------------------------------

class WithBatchNorm(Module):
    def __init__(self):
        super().__init__()
        from mpidl.nn import BatchNorm1d

        self.lin = Linear(4, 3, seed=1, dtype="float64")
        self.norm = BatchNorm1d(3, dtype="float64")

    def forward(self, x):
        return self.norm(self.lin(x))


@pytest.mark.parametrize("stage", STAGES)
def test_plain_batch_norm_statistics_are_rank_0s_before_each_forward_as_data_parallel(
        comm, stage):
    # Without SyncBatchNorm each rank updates the running statistics from its own share;
    # as DataParallel (and PyTorch DDP), ZeRO gives every rank rank 0's before each
    # training forward, so evaluation sums counts from one model, not N.
    from mpidl.parallel import DataParallel

    rng = numpy.random.default_rng(5)
    xs = [rng.standard_normal((3, 4)) * (comm.rank + 1) for _ in range(3)]  # differ by rank
    held = {}
    for kind in ("dp", "zero"):
        model = WithBatchNorm()
        wrapper = (DataParallel(model, comm, shared_memory=False) if kind == "dp"
                   else ShardedDataParallel(model, comm, stage=stage))
        opt = SGD(wrapper.parameters(), lr=0.1)
        for x in xs:
            y = wrapper(x)
            wrapper.backward(F.sum(F.mul(y, y)), global_count=3 * comm.size)
            opt.step()
            opt.zero_grad()
        wrapper.before_forward()  # what the next training forward does first
        held[kind] = [b.copy() for b in model.buffers()]
        wrapper.close()
    first = comm.bcast_obj([b.tolist() for b in held["zero"]])
    same = all(numpy.array_equal(b, numpy.array(f)) for b, f in zip(held["zero"], first))
    assert_all_ranks(comm, same, "running statistics differ from rank 0's")
    for a, b in zip(held["zero"], held["dp"]):
        assert_allclose_all_ranks(comm, a, b, what="running statistics against DataParallel")


# -- stage 3's reduction order ---------------------------------------------------------------

class Blocks(Module):
    """Three blocks of equal shapes (so equal unit sizes): a mis-ordered reduce-scatter
    would pair one unit's gradient with another's and sum silently."""

    def __init__(self):
        super().__init__()
        from mpidl.nn import ModuleList

        self.blocks = ModuleList([TwoHeads() for _ in range(3)])

    def forward(self, x, use_b):
        for i, block in enumerate(self.blocks):
            x = F.tanh(block(x, use_b and i == 1) @ numpy.ones((3, 4)) * 0.1)
        return x


def test_stage_3_reduces_in_one_order_when_a_rank_leaves_a_parameter_without_gradient(comm):
    # Only rank 0's batch reaches the middle block's head b: elsewhere that unit is not
    # final when the others are. Every rank must still reduce the units in one order.
    sdp = ShardedDataParallel(Blocks(), comm, stage=3)
    ref = Blocks()
    opt, ref_opt = SGD(sdp.parameters(), lr=1.0), SGD(ref.parameters(), lr=1.0)
    n = 2 * comm.size
    for step in range(2):
        sdp.backward(F.sum(sdp(numpy.full((2, 4), comm.rank + 1.0), comm.rank == 0)),
                     global_count=n)
        opt.step()
        opt.zero_grad()
        reference_step(ref_opt, every_ranks_loss(ref, comm.size, lambda r: r == 0))
        assert_same_as(comm, sdp, ref, f"step {step}")
    sdp.close()


class StartedGathers:
    """The replicas' communicator, counting the non-blocking allgathers started on it
    (stage 3's prefetches); every call goes through to the real one."""

    def __init__(self, comm):
        self.comm, self.started = comm, 0

    def iallgather(self, x):
        self.started += 1
        return self.comm.iallgather(x)


def test_stage_3_prefetches_the_next_units_gather_in_forward_and_backward(comm):
    # Three units (the blocks; the model holds nothing else). The first forward learns
    # the order, so only its backward prefetches (units 1 and 0, behind 2 and 1); every
    # later step prefetches the next unit in forward too: L - 1, then 2 (L - 1) a step.
    # The numbers do not change without prefetching, only the overlap is lost.
    sdp = ShardedDataParallel(Blocks(), comm, stage=3)
    counted = sdp.gathers.comm = StartedGathers(comm)
    opt = SGD(sdp.parameters(), lr=0.1)
    started = []
    for _ in range(3):
        sdp.backward(F.sum(sdp(numpy.full((2, 4), comm.rank + 1.0), True)), global_count=2)
        opt.step()
        opt.zero_grad()
        started.append(counted.started)
    sdp.close()
    assert_all_ranks(comm, started == [2, 6, 10],
                     f"prefetches started after each of 3 steps: {started}, not [2, 6, 10]")
