"""A pipeline stage builds only its own layers, with the values of the whole build.

``GPT(keep=stage_keeps(...))`` draws every value the whole build draws (the skipped
layers' a chunk at a time, dropped) and keeps only its stage's: the kept parameters
and dropout generators equal the whole model's bit for bit, the others are placeholders
of one element. Under 1 s for the file.
"""
from __future__ import annotations

import numpy
import pytest

from mpidl.models import GPT
from mpidl.nn import init
from mpidl.parallel import ProcessGrid
from mpidl.parallel.pipeline_gpt import pipeline_gpt, pipeline_model, stage_keeps
from mpidl.testing import run_ranks

SHAPE = dict(vocab=23, seq_len=8, dim=8, layers=5, heads=2, dropout=0.1, seed=4)


def generators(model):
    return {n: m.rng.bit_generator.state["state"]["state"]
            for n, m in model.named_modules() if isinstance(getattr(m, "rng", None),
                                                           numpy.random.Generator)}


@pytest.mark.parametrize("stages, virtual, tie", [(2, 1, True), (3, 1, False), (2, 2, True)])
def test_a_stage_built_gpt_keeps_the_whole_builds_values_and_nothing_else(stages, virtual,
                                                                         tie):
    whole = GPT(**SHAPE, tie_weights=tie)
    values = dict(whole.named_parameters())
    held = set()
    for stage in range(stages):
        keep = stage_keeps(5, stages, virtual, stage, tie_weights=tie)
        part = GPT(**SHAPE, tie_weights=tie, keep=keep)
        for name, p in part.named_parameters():
            top = name.split(".")[0] if not name.startswith("blocks.") \
                else ".".join(name.split(".")[:2])
            if top in keep:
                assert numpy.array_equal(p.data, values[name].data), (stage, name)
                assert p.data.flags.writeable
                held.add(name)
            else:
                assert init.is_placeholder(p.data), (stage, name)
                assert p.data.shape == values[name].data.shape
        # The kept blocks' dropout masks come from the same generators as the whole's.
        mine = generators(part)
        assert {n: mine[n] for n in mine if n.split(".")[1] in
                {k.split(".")[1] for k in keep if k.startswith("blocks.")}} \
            == {n: s for n, s in generators(whole).items() if n.split(".")[1] in
                {k.split(".")[1] for k in keep if k.startswith("blocks.")}}
    assert held == set(values)  # every parameter on one stage or another


def test_a_stage_holds_its_share_of_the_bytes():
    # 8 blocks in 4 stages: a middle stage holds its 2 blocks (and placeholders of one
    # element each), a quarter of the blocks' bytes and no embedding.
    shape = dict(SHAPE, layers=8, dim=32)
    whole = GPT(**shape)
    block = sum(p.data.nbytes for p in whole.blocks[0].parameters())
    part = GPT(**shape, keep=stage_keeps(8, 4, 1, 1))
    real = sum(p.data.nbytes for p in part.parameters() if not init.is_placeholder(p.data))
    assert real == 2 * block


def test_skipped_draws_consume_what_the_whole_draw_does():
    # Past a chunk boundary (CHUNK values at a time): the next draw is the same.
    a, b = numpy.random.default_rng(1), numpy.random.default_rng(1)
    shape = (3, init.CHUNK // 2 + 5)
    init.uniform(shape, 0.1, a)
    init.normal(shape, 0.1, a)
    with init.skipped():
        assert init.is_placeholder(init.uniform(shape, 0.1, b))
        assert init.is_placeholder(init.normal(shape, 0.1, b))
    assert a.random() == b.random()


def both(comm, **options):
    """A stage-built pipeline and one cut from the whole model: their parameters."""
    grid = ProcessGrid(comm, pipeline=2, **options)
    built = pipeline_gpt(grid, microbatches=2, **SHAPE)
    cut = pipeline_model(GPT(**SHAPE), grid, microbatches=2)
    out = [[(n, p.data.copy()) for n, p in m.module.named_parameters()] for m in (built, cut)]
    grid.free()
    return out


@pytest.mark.parametrize("ranks, options", [(2, {}), (4, {"tensor": 2})])
def test_pipeline_gpt_builds_the_stage_the_whole_model_is_cut_into(ranks, options):
    for built, cut in run_ranks(ranks, both, **options):
        assert [n for n, _ in built] == [n for n, _ in cut] and built
        for (name, a), (_, b) in zip(built, cut):
            assert numpy.array_equal(a, b), name
