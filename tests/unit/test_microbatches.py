"""Gradient accumulation (``--microbatches m``): one optimizer step over m microbatches of
each rank's share equals the one-microbatch step, to rounding, in float64, on thread
ranks, for data parallelism and every ZeRO stage (:class:`mpidl.train.step.TrainStep`)."""
from __future__ import annotations

import dataclasses

import numpy
import pytest

from mpidl.comm import split_counts
from mpidl.models import GPT, mlp
from mpidl.optim import AdamW
from mpidl.parallel import DataParallel, ShardedDataParallel
from mpidl.testing import run_ranks
from mpidl.testing.tolerance import allclose
from mpidl.train.build import Run, check_microbatches
from mpidl.train.config import Config, ConfigError, load_config
from mpidl.train.layout import Layout, plan_layout
from mpidl.train.objective import Classification, LanguageModel
from mpidl.train.metrics import StepTimer
from mpidl.train.step import TrainStep
from mpidl.train.timeline import Timeline

STEPS = 3


def _wrap(model, comm, kind):
    if kind == "dp":
        return DataParallel(model, comm, shared_memory=False)
    return ShardedDataParallel(model, comm, stage=int(kind[-1]))


def _train(comm, kind, microbatches, task, global_batch, timer=None, **grid):
    """STEPS AdamW steps of TrainStep; this rank's parameters (or shards), its losses."""
    config = Config(task="gpt" if task == "gpt" else "reviews", global_batch=global_batch,
                    microbatches=microbatches, lr=1e-2, schedule="constant", warmup_steps=0,
                    clip_grad_norm=0.5, zero=0 if kind == "dp" else int(kind[-1]), **grid)
    if task == "mlp":
        model, objective = mlp(sizes=(7, 11, 5), seed=4, dtype="float64"), Classification()
    else:  # padded targets count nothing: the global count is the real tokens'
        model = GPT(vocab=13, seq_len=6, dim=8, layers=2, heads=2, pad_id=0, seed=4,
                    dtype="float64")
        objective = LanguageModel(pad_id=0)
    layout = Layout(plan_layout(config, comm.size, model, 5), comm)
    if layout.grid is not None:  # tensor x sequence grids: the model's shards
        model, objective = layout.split_model(model), objective.split_over(layout.grid)
    wrapper = _wrap(model, layout.replicas, kind)
    run = Run(config=config, comm=comm, xp=numpy, threads=None, train_set=None,
              test_set=None, objective=objective, layout=layout, model=model,
              dp=wrapper, optimizer=AdamW(wrapper.parameters(), lr=1e-2), loader=None,
              eval_loader=None, loss_scale=None, total_steps=STEPS)
    step = TrainStep(run, timer=timer)
    start = [p.data.copy() for p in wrapper.parameters()]
    losses = []
    for i in range(STEPS):
        rng = numpy.random.default_rng(100 + i)  # the same global batch on every rank
        if task == "mlp":
            x_all = rng.standard_normal((global_batch, 7))
            y_all = rng.integers(0, 5, global_batch)
        else:
            x_all = rng.integers(1, 13, (global_batch, 6))
            x_all[:, 4:] = 0  # padding: 3 real targets of 5 per sequence
            y_all = None
        data = layout.data  # the ranks of a tensor x sequence group read the same rows
        counts = split_counts(global_batch, data.size)
        lo = sum(counts[:data.rank])
        mine = slice(lo, lo + counts[data.rank])
        result = step(x_all[mine], None if y_all is None else y_all[mine], global_batch, i)
        losses.append(float(result.loss))
    params = [p.data.copy() for p in wrapper.parameters()]  # ZeRO: this rank's shards
    wrapper.close()
    moved = not all(numpy.array_equal(a, b) for a, b in zip(start, params))
    return params, losses, moved


@pytest.mark.parametrize("ranks,kind", [(2, "dp"), (3, "dp"), (2, "zero1"), (3, "zero2"),
                                        (2, "zero3")])
def test_microbatches_equal_one_batch_on_data_parallel_and_zero(ranks, kind):
    # 11 samples over the ranks (6+5 or 4+4+3), then 3 microbatches each: uneven everywhere.
    one = run_ranks(ranks, _train, kind, 1, "mlp", 11)
    three = run_ranks(ranks, _train, kind, 3, "mlp", 11)
    _same(one, three)


def _same(one, three):
    for (p1, l1, moved), (p3, l3, _) in zip(one, three):
        assert moved  # the steps trained: a comparison of untouched parameters proves nothing
        assert numpy.allclose(l3, l1, rtol=1e-12, atol=0)  # this rank's loss sums
        assert len(p1) == len(p3)
        for a, b in zip(p3, p1):
            assert allclose(a, b, numpy.float64)


@pytest.mark.parametrize("kind", ["dp", "zero2"])
def test_microbatches_of_a_language_model_divide_by_the_real_tokens_once(kind):
    one = run_ranks(2, _train, kind, 1, "gpt", 7)
    three = run_ranks(2, _train, kind, 3, "gpt", 7)
    _same(one, three)


def test_more_microbatches_than_samples_is_a_config_error_naming_the_values():
    with pytest.raises(ConfigError, match="--microbatches=9 is more than the --global-batch=8"):
        load_config("gpt", ["--global-batch=8", "--microbatches=9"])
    with pytest.raises(ConfigError, match="must be >= 1"):
        load_config("gpt", ["--microbatches=0"])
    config = dataclasses.replace(Config(), global_batch=8, microbatches=3)
    check_microbatches(config, 2)  # 4 samples each: fine
    with pytest.raises(ConfigError, match=r"--microbatches=3 is more than the 2 sample\(s\) "
                                          r"the smallest of 3 data ranks gets of "
                                          r"--global-batch=8: use --microbatches=2"):
        check_microbatches(config, 3)


@pytest.mark.parametrize("grid", [dict(tensor_parallel=2),
                                  dict(tensor_parallel=2, megatron_sequence_parallel=True),
                                  dict(sequence_parallel="ring", sequence_parallel_size=2)])
def test_microbatches_equal_one_batch_on_tensor_and_sequence_grids(grid):
    # 4 ranks: 2 data ranks x a group of 2; 7 sequences, 4 + 3, then 3 microbatches each.
    one = run_ranks(4, _train, "dp", 1, "gpt", 7, **grid)
    three = run_ranks(4, _train, "dp", 3, "gpt", 7, **grid)
    _same(one, three)


@pytest.mark.parametrize("kind", ["zero1", "zero3"])
def test_microbatches_equal_one_batch_on_a_tensor_grid_under_zero(kind):
    one = run_ranks(4, _train, kind, 1, "gpt", 7, tensor_parallel=2)
    three = run_ranks(4, _train, kind, 3, "gpt", 7, tensor_parallel=2)
    _same(one, three)


def test_a_backward_that_did_not_communicate_adds_no_wait_to_the_timeline():
    # Data parallelism reduces once per step: one "comm" event a step, not m (no_sync's
    # backwards leave the previous wait in place, which was counted again).
    def body(comm, kind):
        timeline = Timeline(comm.rank)
        _train(comm, kind, 3, "mlp", 11, timer=StepTimer(timeline))
        return sum(1 for e in timeline.events if e[0] == "comm")

    assert run_ranks(2, body, "dp") == [STEPS, STEPS]
    assert run_ranks(2, body, "zero2") == [3 * STEPS, 3 * STEPS]  # a reduce-scatter each
