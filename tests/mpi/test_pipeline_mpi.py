"""Pipeline parallelism on real ranks: every rank a stage, at any size.

Each rank also runs the single-rank reference (gradient accumulation over the same
microbatch split) and compares the pipelined model's full state with it; the verdict is
collective. The pipeline communicator checks every message's shape and dtype
(what MPIDL_CHECK_COLLECTIVES=1 turns on).
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.comm import split_counts
from mpidl.models import gpt
from mpidl.optim import AdamW
from mpidl.parallel import ProcessGrid
from mpidl.parallel.pipeline_gpt import pipeline_gpt
from mpidl.testing import allclose, assert_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

KW = dict(vocab=31, seq_len=8, dim=16, heads=2, seed=5, dtype="float64")


def _reference(kw, batches, m):
    model = gpt(**kw)
    opt = AdamW(model.parameters(), lr=1e-2)
    for ids in batches:
        n = model.count_targets(ids)
        starts = numpy.cumsum([0] + split_counts(len(ids), m))
        for i in range(m):
            model.loss(ids[starts[i]:starts[i + 1]]).backward(numpy.full((), 1.0 / n))
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("schedule,v,tie", [("1f1b", 1, False), ("gpipe", 1, True),
                                            ("interleaved", 2, True)])
def test_every_rank_a_stage_equals_one_rank(comm, schedule, v, tie):
    p = comm.size
    m = 2 * p
    kw = dict(KW, layers=p * v, tie_weights=tie)
    rng = numpy.random.default_rng(1)
    batches = [rng.integers(0, 31, size=(2 * m + 1, 9)) for _ in range(2)]
    grid = ProcessGrid(comm, pipeline=p)
    grid.pipeline.check_collectives = True  # shapes and dtypes of every message compared
    model = pipeline_gpt(grid, microbatches=m, schedule=schedule, virtual_stages=v, **kw)
    opt = AdamW(model.parameters(), lr=1e-2)
    for ids in batches:
        model.step(ids)
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict()
    want = _reference(kw, batches, m)
    bad = [k for k, a in want.items() if not (numpy.array_equal(state[k], a) if not tie
                                             else allclose(state[k], a, scale=10))]
    assert_all_ranks(comm, list(state) == list(want) and not bad, f"{bad}")
    grid.free()
