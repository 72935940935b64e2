"""Pipeline parallelism against single-rank gradient accumulation, on thread ranks.

float64, a tiny GPT, three AdamW steps; the reference runs the same microbatch split of
the same batches on one rank. Without tied weights or a data axis the pipeline adds the
same numbers in the same order: equal bit for bit. Otherwise to rounding (the tied
weight's two gradients, and the replicas' sums, are added in another order).
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.comm import DistributedError, split_counts
from mpidl.models import gpt
from mpidl.optim import AdamW
from mpidl.parallel import ProcessGrid, ShardedDataParallel
from mpidl.parallel.pipeline_gpt import pipeline_gpt, split_layers
from mpidl.testing import allclose, run_ranks

BASE = dict(vocab=31, seq_len=8, dim=16, layers=4, heads=2, seed=3, dtype="float64")
STEPS = 3


def _batches(rows, data=1, seed=0):
    rng = numpy.random.default_rng(seed)
    return [[rng.integers(0, 31, size=(rows, 9)) for _ in range(data)] for _ in range(STEPS)]


def reference(kw, batches, m):
    """One rank: every data rank's microbatches in turn, the summed loss seeded 1/N."""
    model = gpt(**kw)
    opt = AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in batches:
        n = sum(model.count_targets(ids) for ids in step)
        total = []
        for ids in step:
            rows = split_counts(len(ids), m)
            starts = numpy.cumsum([0] + rows)
            part = 0.0
            for i in range(m):
                loss = model.loss(ids[starts[i]:starts[i + 1]], reduction="sum")
                part += float(loss.data)
                loss.backward(numpy.full((), 1.0 / n))
            total.append(part)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.copy() for k, v in model.state_dict().items()}


def pipelined(comm, kw, batches, m, grid_sizes, **options):
    grid = ProcessGrid(comm, **grid_sizes)
    model = pipeline_gpt(grid, microbatches=m, **options, **kw)
    opt = AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in batches:
        loss, _ = model.step(step[grid.data_rank])
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return (grid.pipeline_rank, *grid.coordinates), losses, model.full_state_dict(), \
        model.peak_activation_bytes


def run(size, grid_sizes, m=4, rows=7, data=1, exact=True, options=None, **kw):
    kw = {**BASE, **kw}
    batches = _batches(rows, data)
    ref_losses, ref_state = reference(kw, batches, m)
    results = run_ranks(size, pipelined, kw, batches, m, grid_sizes, **(options or {}))
    summed = {}  # data rank -> its losses, the sequence ranks' shares added up
    for (stage, d, s, t), losses, state, _ in results:
        assert list(state) == list(ref_state)
        for name, value in ref_state.items():
            if exact:
                numpy.testing.assert_array_equal(state[name], value, err_msg=name)
            else:
                assert allclose(state[name], value, scale=10), name
        if t == 0 and stage == 0:  # every stage returns the same loss
            summed[d] = summed.get(d, 0) + numpy.array(losses)
    for d, losses in summed.items():
        shares = numpy.array([ref[d] for ref in ref_losses])
        if exact:
            numpy.testing.assert_array_equal(losses, shares)
        else:
            assert allclose(losses, shares), (losses, shares)
    return results


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 4])
def test_gpipe_and_1f1b_equal_single_rank_accumulation_bit_for_bit(schedule, p):
    run(p, dict(pipeline=p), tie_weights=False, options=dict(schedule=schedule))


def test_interleaved_with_two_chunks_per_stage_equals_single_rank_bit_for_bit():
    run(2, dict(pipeline=2), m=4, layers=8, tie_weights=False,
        options=dict(schedule="interleaved", virtual_stages=2))


def test_microbatches_that_do_not_divide_the_batch_and_dropout_match_too():
    # 7 rows in 4 microbatches (2, 2, 2, 1); every block's Dropout draws its masks in
    # microbatch order on its stage, as on one rank.
    run(4, dict(pipeline=4), m=4, rows=7, dropout=0.3, tie_weights=False)


def test_stages_of_unequal_layer_counts_match():
    run(2, dict(pipeline=2), layers=5, tie_weights=False, options=dict(part_layers=[1, 4]))


def test_tied_embeddings_stay_one_parameter_across_the_first_and_last_stage():
    # The pipeline adds the embedding's and the head's gradients per step, one rank
    # per microbatch: the same sum in another order.
    results = run(4, dict(pipeline=4), tie_weights=True, exact=False)
    assert "head.weight" not in results[0][2] and "tok.weight" in results[0][2]


def test_a_data_axis_reduces_each_stage_over_its_replicas():
    run(4, dict(pipeline=2), data=2, exact=False, tie_weights=True)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_wraps_each_stage_as_data_parallelism_would(stage):
    run(4, dict(pipeline=2), data=2, exact=False, tie_weights=True,
        options=dict(wrapper=lambda module, comm: ShardedDataParallel(module, comm,
                                                                      stage=stage)))


def test_zero_3_is_refused_on_every_rank_saying_what_works():
    def build(comm):
        pipeline_gpt(ProcessGrid(comm, pipeline=2), microbatches=2, **BASE,
                     wrapper=lambda module, c: ShardedDataParallel(module, c, stage=3))

    errors = run_ranks(4, build, return_exceptions=True)
    assert all(isinstance(e, DistributedError) and "use ZeRO stage 1 or 2" in str(e)
               for e in errors), errors


@pytest.mark.parametrize("grid,options", [
    (dict(pipeline=2, tensor=2), {}), (dict(pipeline=2, sequence=2), {}),
    (dict(pipeline=2, tensor=2), dict(sequence_parallel=True, schedule="interleaved",
                                      virtual_stages=2))])
def test_pipeline_by_tensor_and_by_sequence_grids_match_to_rounding(grid, options):
    # The activation between stages is this rank's shard: (b, T_here, D), with
    # Megatron's sequence parallelism T_here / t.
    run(4, grid, exact=False, tie_weights=True, options=options)


def test_a_layer_list_that_does_not_sum_to_the_layers_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"pipeline layers \[1, 2\] \(sum 3, 2 parts\) do not "
                       r"split 4 blocks into 2 parts.*e\.g\. \[2, 2\]"):
        split_layers(4, 2, [1, 2])


def _peaks(comm, schedule, m, rows, recompute):
    grid = ProcessGrid(comm, pipeline=4)
    model = pipeline_gpt(grid, microbatches=m, schedule=schedule, **{
        **BASE, "layers": 8, "tie_weights": False, "recompute": recompute})
    model.measure_graphs = True
    model.step(_batches(rows)[0][0])
    return model.peak_activation_bytes, model.peak_graph_bytes


def test_1f1b_holds_p_minus_r_microbatches_on_stage_r_and_gpipe_m():
    p, m, rows = 4, 8, 16
    one = run_ranks(p, _peaks, "1f1b", m, rows, "none")
    all_ = run_ranks(p, _peaks, "gpipe", m, rows, "none")
    boundary = (rows // m) * 8 * BASE["dim"] * 8  # one (b, T, D) float64 activation
    for r in range(p):
        # The graphs a stage keeps until backward: p - r microbatches' under 1F1B, all
        # m under GPipe (the same bytes per microbatch: uniform microbatches).
        assert one[r][1] * m == all_[r][1] * (p - r), (r, one[r], all_[r])
        if r < p - 1:  # the outputs sent on, held for their backward
            assert (one[r][0], all_[r][0]) == ((p - r) * boundary, m * boundary)
    # Full recomputation keeps only each block's input: 2 blocks per stage.
    full = run_ranks(p, _peaks, "1f1b", m, rows, "full")
    assert [full[r][1] for r in (1, 2)] == [(p - r) * 2 * boundary for r in (1, 2)]


def _clipped(comm, kw, ids, m, grid_sizes):
    from mpidl.optim import SGD

    grid = ProcessGrid(comm, **grid_sizes)
    model = pipeline_gpt(grid, microbatches=m, **kw)
    model.step(ids)
    norm = model.clip_grad_norm_(1e-3)
    SGD(model.parameters(), lr=1.0).step()
    return norm, model.full_state_dict()


def test_clipping_takes_the_norm_of_the_whole_model_over_the_stages():
    from mpidl.optim import SGD, clip_grad_norm_

    kw = {**BASE, "tie_weights": True}
    ids = _batches(6)[0][0]
    model = gpt(**kw)
    n = model.count_targets(ids)
    for mb in numpy.split(ids, 3):
        model.loss(mb, reduction="sum").backward(numpy.full((), 1.0 / n))
    want = float(clip_grad_norm_(model.parameters(), 1e-3))
    SGD(model.parameters(), lr=1.0).step()
    for norm, state in run_ranks(4, _clipped, kw, ids, 3, dict(pipeline=2, tensor=2)):
        assert allclose(numpy.array(norm), numpy.array(want)), (norm, want)
        assert all(allclose(state[k], v) for k, v in model.state_dict().items())


def _moved(comm, state, ids, grid_sizes, options):
    grid = ProcessGrid(comm, **grid_sizes)
    model = pipeline_gpt(grid, microbatches=4, **options, **BASE)
    model.load_full_state_dict(state)
    loss, count = model.evaluate(ids)
    return loss, count, model.full_state_dict()


@pytest.mark.parametrize("grid_sizes,options", [
    (dict(pipeline=4), {}), (dict(pipeline=2), dict(schedule="interleaved", virtual_stages=2)),
    (dict(pipeline=2, tensor=2), dict(part_layers=[3, 1]))])
def test_a_state_dict_loads_into_any_layout_and_evaluates_as_one_rank(grid_sizes, options):
    source = gpt(**{**BASE, "seed": 11})  # other parameters than the layouts' own seed
    state = source.state_dict()
    ids = _batches(5)[0][0]
    want = float(source.loss(ids, reduction="sum").data)
    for loss, count, back in run_ranks(4, _moved, state, ids, grid_sizes, options):
        assert allclose(numpy.array(loss), numpy.array(want)) and count == 5 * 8
        assert all(numpy.array_equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_with_dropout_in_stages_redraws_no_mask(recompute):
    # The reference keeps everything; the stages recompute, each block's Dropout must
    # reuse the forward's seed (a redrawn mask is the classic recomputation bug).
    kw = {**BASE, "dropout": 0.3, "tie_weights": False}
    batches = _batches(6)
    _, want = reference(kw, batches, 3)
    got = run_ranks(2, pipelined, {**kw, "recompute": recompute}, batches, 3, dict(pipeline=2))
    for _, _, state, _ in got:
        for name, value in want.items():
            numpy.testing.assert_array_equal(state[name], value, err_msg=name)


def _resumed(comm, kw, batches, first, second):
    """Two steps in layout ``first``, its full model and optimizer state; loaded into
    layout ``second``, one more step there."""
    out = []
    for layout, steps, state in ((first, batches[:2], None), (second, batches[2:], out)):
        grid = ProcessGrid(comm, **layout.get("grid", {}))
        model = pipeline_gpt(grid, microbatches=4, **layout.get("options", {}), **kw)
        opt = AdamW(model.parameters(), lr=1e-2)
        if state:
            model.load_full_state_dict(state[0])
            model.load_full_optimizer_state(opt, state[1])
        for step in steps:
            model.step(step[0])
            opt.step()
            opt.zero_grad()
        out[:] = [model.full_state_dict(), model.full_optimizer_state(opt)]
        grid.free()
    return out


def test_model_and_optimizer_state_move_between_pipeline_layouts():
    kw = {**BASE, "tie_weights": True}
    batches = _batches(6)
    model = gpt(**kw)
    opt = AdamW(model.parameters(), lr=1e-2)
    for step in batches:
        n = model.count_targets(step[0])
        for mb in numpy.array_split(step[0], 4):
            model.loss(mb, reduction="sum").backward(numpy.full((), 1.0 / n))
        opt.step()
        opt.zero_grad()
    first = dict(grid=dict(pipeline=2, tensor=2))
    second = dict(grid=dict(pipeline=4), options=dict(part_layers=[0, 2, 2, 0]))
    for state, optimizer in run_ranks(4, _resumed, kw, batches, first, second):
        assert all(allclose(state[k], v, scale=10) for k, v in model.state_dict().items())
        want = opt.state_dict()
        assert sorted(optimizer) == sorted(want) and optimizer["step"] == want["step"]
        assert all(allclose(optimizer[k], v, scale=10) for k, v in want.items()
                   if hasattr(v, "shape"))
