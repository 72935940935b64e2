"""``mpidl train gpt --pipeline-parallel p`` (and ``--recompute``), the whole command on
thread ranks in this process: a pipelined run equals the single-rank run with as many
microbatches (gradient accumulation) to rounding in float64; its checkpoints resume at
its own layout bit for bit and at any other to rounding; impossible layouts are exit 2
saying what works; recomputation trains bit for bit as keeping the activations does.

Each run is a few steps of a tiny gpt (under a second on 1-4 thread ranks)."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import numpy
import pytest

from mpidl.models import GPT, mlp
from mpidl.testing import run_ranks
from mpidl.train import latest_checkpoint, load_checkpoint
from mpidl.train.build import apply_recompute
from mpidl.train.command import _train
from mpidl.train.config import ConfigError, load_config
from mpidl.train.layout import plan_layout
from mpidl.train.signals import PreemptionFlag

# 7 sequences a step (uneven over 2 data ranks and over 3 microbatches), dropout on, the
# norm clipped to 0.05 (the preset's 1.0 clipped nothing here: a stage-local norm went
# unnoticed, mutation train-pipeline-clips-each-stage-alone): every part of the step.
TINY = ["gpt", "--data.num-train=56", "--data.num-test=9", "--global-batch=7",
        "--steps=3", "--epochs=1", "--progress=never", "--keep-freed-memory=false",
        "--model.dtype=float64", "--model.layers=4", "--model.dim=16", "--model.dropout=0.1",
        "--log-every=1", "--microbatches=3", "--clip-grad-norm=0.05"]


def train(tmp_path, ranks, run_dir, *args):
    """``mpidl train`` on ``ranks`` thread ranks; the exit codes."""
    argv = [*TINY, f"--data.cache-dir={tmp_path / 'cache'}", f"--run-dir={tmp_path / run_dir}",
            *args]
    return run_ranks(ranks, lambda comm: _train(argv, comm, PreemptionFlag(None)))


def state(tmp_path, run_dir):
    """The last checkpoint's single-rank model and optimizer state, and the run's losses."""
    found = load_checkpoint(latest_checkpoint(os.path.join(tmp_path / run_dir, "checkpoints")))
    with open(tmp_path / run_dir / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    return found, [r["loss"] for r in records if r["kind"] == "train"]


def assert_same(a, b, exact=False):
    """Equal checkpoints (model, optimizer) and losses: bit for bit, or to rounding (the
    attention's key bias has a gradient of rounding noise only, which Adam's update
    scales up to ~1e-13 in float64)."""
    (ca, la), (cb, lb) = a, b
    assert ca.step == cb.step and sorted(ca.model) == sorted(cb.model)
    close = numpy.array_equal if exact else (
        lambda x, y: numpy.allclose(x, y, rtol=1e-9, atol=1e-11))
    for name in ca.model:
        assert close(ca.model[name], cb.model[name]), name
    for key, value in ca.optimizer.items():
        if isinstance(value, numpy.ndarray):
            assert close(value, cb.optimizer[key]), key
    assert close(numpy.array(la), numpy.array(lb))


def once(tmp, ranks, *args):
    """The state of the run on ``ranks`` ranks with ``args`` (run once in the module)."""
    name = f"{ranks}" + "".join(a.strip("-").replace("=", "") for a in args)
    if not os.path.isdir(tmp / name / "checkpoints"):
        assert train(tmp, ranks, name, *args) == [0] * ranks
    return state(tmp, name)


def single_rank(tmp, *args):
    return once(tmp, 1, *args)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One rank, no pipeline, the same 3 microbatches a step: gradient accumulation."""
    tmp = tmp_path_factory.mktemp("pipeline")
    assert train(tmp, 1, "one") == [0]
    return tmp, state(tmp, "one")


@pytest.mark.parametrize("ranks, layout", [
    (2, ["--pipeline-parallel=2"]),
    (4, ["--pipeline-parallel=2", "--tensor-parallel=2", "--megatron-sequence-parallel"]),
    (4, ["--pipeline-parallel=2", "--sequence-parallel=ring"]),  # loss shares over s = 2
    (2, ["--pipeline-parallel=2", "--pipeline-schedule=interleaved", "--virtual-stages=2",
         "--microbatches=4"]),
    # Two data ranks draw dropout masks of their own: dropout off, against its reference.
    (4, ["--pipeline-parallel=2", "--zero=1", "--schedule=gpipe", "--model.dropout=0"]),
])
def test_a_pipelined_run_equals_single_rank_gradient_accumulation(reference, ranks, layout):
    tmp, one = reference
    # The reference runs the same microbatches (dropout masks are drawn per microbatch).
    same = [a for a in layout if a.startswith(("--model.dropout", "--microbatches"))]
    if same:
        one = single_rank(tmp, *same)
    assert_same(once(tmp, ranks, *layout), one)


def records(tmp, run_dir):
    """The run's (kind, accuracy or test_accuracy) records, in order."""
    with open(tmp / run_dir / "metrics.jsonl") as f:
        found = [json.loads(line) for line in f]
    return [(r["kind"], r.get("accuracy", r.get("test_accuracy")))
            for r in found if r["kind"] in ("train", "eval")]


@pytest.mark.parametrize("ranks, layout", [
    (2, ["--pipeline-parallel=2"]),
    (4, ["--pipeline-parallel=2", "--tensor-parallel=2", "--megatron-sequence-parallel"]),
])
def test_pipelined_records_carry_the_single_rank_next_token_accuracy(reference, ranks,
                                                                     layout):
    # The last stage counts the hits (vocabulary-sharded under tensor=2) and every stage
    # reports them: train records each step, the eval record at the end.
    tmp, _ = reference
    once(tmp, ranks, *layout)  # the run of the test above (made here if alone)
    got = records(tmp, f"{ranks}" + "".join(a.strip("-").replace("=", "") for a in layout))
    want = records(tmp, "one")
    assert [k for k, _ in got] == [k for k, _ in want] and "eval" in dict(want)
    # Hits in step 3 and in the evaluation (none in steps 1-2: 0.0, not null).
    assert all(a is not None for _, a in want) and want[-1][1] > 0 and want[-2][1] > 0
    assert [a for _, a in got] == pytest.approx([a for _, a in want], abs=1e-12)


def test_a_pipeline_checkpoint_resumes_at_other_layouts(reference):
    # p = 2 x tensor 2 saved, p = 4 (a layer a stage, 4 microbatches) resumes it, no
    # pipeline resumes that: the single-rank run to rounding (dropout off: the masks
    # are drawn per microbatch, and p = 4 needs 4 of them). At its own layout a
    # checkpoint resumes bit for bit (the next test).
    tmp, _ = reference
    p2 = ["--pipeline-parallel=2"]
    off = "--model.dropout=0"
    assert train(tmp, 4, "moves", *p2, off, "--tensor-parallel=2", "--stop-at-step=1") \
        == [0] * 4
    assert train(tmp, 4, "moves", off, "--pipeline-parallel=4", "--microbatches=4",
                 "--stop-at-step=2") == [0] * 4
    assert train(tmp, 1, "moves", off) == [0]
    assert_same(state(tmp, "moves"), single_rank(tmp, off))


def test_a_pipeline_checkpoint_resumes_at_its_layout_bit_for_bit(reference):
    # Here with ZeRO-1: each stage's blocks under the single-rank names; two data ranks,
    # whose dropout generators (each its stages') are saved by data rank.
    tmp, _ = reference
    args = ["--pipeline-parallel=2", "--zero=1", "--schedule=gpipe"]
    assert train(tmp, 4, "z-stop", *args, "--stop-at-step=2") == [0] * 4
    assert train(tmp, 4, "z-stop", *args) == [0] * 4
    assert_same(state(tmp, "z-stop"), once(tmp, 4, *args), exact=True)


@pytest.mark.parametrize("args, words", [
    (["--pipeline-parallel=4", "--microbatches=2"],
     "2 microbatches for 4 stages; use at least 4"),
    (["--pipeline-parallel=3"], "--pipeline-parallel=3 does not divide the 4 ranks"),
    (["--pipeline-parallel=2", "--virtual-stages=4", "--schedule=interleaved",
      "--microbatches=4"], "= 8 model chunks, but the gpt model has 4 layers"),
    (["--pipeline-parallel=2", "--virtual-stages=2", "--microbatches=4"],
     "runs one chunk per rank, not 2; use schedule='interleaved'"),
    (["--pipeline-parallel=2", "--pipeline-schedule=interleaved", "--virtual-stages=2",
      "--microbatches=3"], "3 microbatches is not a multiple of the 2 stages"),
    (["--pipeline-parallel=2", "--zero=3", "--microbatches=2"],
     "use --zero=1 or --zero=2 per stage"),
    (["--virtual-stages=2"], "model chunks interleave over pipeline stages; add "
                             "--pipeline-parallel=2"),
    # The rule mpidl plan --layouts refuses with too (test_plan_command).
    (["--pipeline-parallel=2", "--pipeline-schedule=interleaved", "--microbatches=2"],
     "--virtual-stages=1 is plain 1F1B: --pipeline-schedule=interleaved needs 2 or more"),
])
def test_an_impossible_pipeline_layout_is_a_config_error_saying_what_works(args, words):
    config = load_config("gpt", ["--model.layers=4", "--global-batch=8", *args])
    model = GPT(vocab=11, seq_len=8, dim=8, layers=4, heads=2, seed=0)
    with pytest.raises(ConfigError, match=re.escape(words)):
        plan_layout(config, 4, model, 8)


def test_a_pipeline_of_a_model_that_is_not_gpt_is_refused():
    config = load_config("reviews", ["--pipeline-parallel=2"])
    with pytest.raises(ConfigError, match="splits the gpt model's layers into stages; this "
                                          "run's task is 'reviews' with the model 'bow'"):
        plan_layout(config, 2, mlp(sizes=(4, 4, 2)), 1)


def test_the_command_exits_2_on_every_rank_with_one_message(tmp_path, capsys):
    assert train(tmp_path, 2, "bad", "--pipeline-parallel=2", "--microbatches=1") == [2, 2]
    err = capsys.readouterr().err
    assert err.count("1 microbatches for 2 stages; use at least 2") == 1


def test_recompute_is_refused_for_a_model_without_transformer_blocks():
    config = load_config("reviews", ["--recompute=selective"])
    with pytest.raises(ConfigError, match="--recompute=selective: the 'bow' model has no "
                                          "transformer blocks"):
        apply_recompute(config, mlp(sizes=(4, 4, 2)))
    apply_recompute(dataclasses.replace(config, recompute="none"), mlp(sizes=(4, 4, 2)))


def test_recomputation_trains_bit_for_bit_as_keeping_the_activations(reference):
    # Dropout on: a recomputed forward redraws no mask (mpidl.nn.recompute); selective
    # is the same wiring (test_the_recompute_key_sets_every_block).
    tmp, one = reference
    assert_same(single_rank(tmp, "--recompute=full"), one, exact=True)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_recompute_key_sets_every_block(mode):
    model = GPT(vocab=11, seq_len=8, dim=8, layers=3, heads=2, seed=0)
    apply_recompute(load_config("gpt", [f"--recompute={mode}"]), model)
    assert [block.recompute for block in model.blocks] == [mode] * 3
