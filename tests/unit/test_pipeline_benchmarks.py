"""The logic of the pipeline benchmarks (#26): benchmarks/pipeline_bubble.py's held-compute
model runs in the real engine and trains like a model, and pipeline_throughput.py's
step rate is the batch over the median step after the warm-up."""
from __future__ import annotations

import importlib.util
import os

import numpy
import pytest

from mpidl.parallel import ProcessGrid
from mpidl.testing import run_ranks

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}",
                                                  os.path.join(BENCHMARKS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bubble = _load("pipeline_bubble")
throughput = _load("pipeline_throughput")


def _held_step(comm, schedule, v, m, rows, seq, width):
    args = bubble.parse_args(["--compute", "hold", "--forward-ms", "0", "--backward-ms", "0",
                              "--hold-width", str(width)])
    grid = ProcessGrid(comm, pipeline=comm.size)
    model = bubble.build(grid, schedule, m, v, args)
    loss, count = model.step(numpy.zeros((m * rows, seq + 1), dtype=numpy.int64))
    grads = [float(param.grad[0]) for param in model.parameters()]
    model.close()
    return loss, count, grads, model.wait_seconds <= model.step_seconds


@pytest.mark.parametrize("schedule, v, width", [("gpipe", 1, 1), ("1f1b", 1, 3),
                                                ("interleaved", 2, 1)])
def test_held_parts_run_every_schedule_and_each_weight_gets_its_gradient(schedule, v, width):
    p, m, rows, seq = 4, 4, 2, 3
    for loss, count, grads, timed in run_ranks(p, _held_step, schedule, v, m, rows, seq,
                                               width):
        # Every token's activation is `width` copies of the sum of the p v parts'
        # weights (all 1); the loss sums it over the m * rows * seq tokens, so each
        # weight's gradient, divided by the count once, is `width` (float32 sums).
        assert count == m * rows * seq
        assert loss == count * p * v * width
        assert grads == pytest.approx([width] * v, rel=1e-6)
        assert timed


def test_the_formula_is_the_idle_over_busy_time_of_the_schedule():
    assert bubble.formula(2, 4, 1) == 0.25
    assert bubble.formula(4, 8, 2) == 3 / 16


def test_the_step_rate_is_the_batch_over_the_median_step_after_the_warmup():
    records = [{"kind": "train", "step": 1, "time_step": 9.0, "pipeline_bubble": [9, 9]},
               {"kind": "eval", "step": 1},
               *[{"kind": "train", "step": s, "time_step": t, "pipeline_bubble": [b, 2 * b]}
                 for s, t, b in ((2, 1.0, 0.1), (3, 4.0, 0.3), (4, 2.0, 0.2))]]
    assert throughput.step_rate(records, batch=8, warmup=1) == (4.0, "0.20 0.40")
    plain = [{k: v for k, v in r.items() if k != "pipeline_bubble"} for r in records]
    assert throughput.step_rate(plain, batch=8, warmup=1) == (4.0, "-")
    with pytest.raises(ValueError, match="no train records after step 4"):
        throughput.step_rate(records, batch=8, warmup=4)
