"""`mpidl train gpt --tensor-parallel k --sequence-parallel ulysses|ring
--sequence-parallel-size s`: every layout trains the single-rank model's steps, its
checkpoints hold the full parameters and resume at another layout, and impossible
layouts are configuration errors (exit 2) that say what would work."""
from __future__ import annotations

import json
import os
import sys

import numpy
import pytest

from mpidl.testing.launch import mpiexec

pytestmark = [pytest.mark.timeout(600)]

# float64: the layouts differ from one rank only by summation order, so after 12 Adam
# steps the parameters agree to ~1e-12, where float32 would leave ~1e-5 of noise. The
# sequence is 15 tokens (16 per row): not divisible by 2 or 4 ranks, nor by a zigzag's
# 2 s chunks; 3 heads do not divide over 2 tensor ranks (2 + 1).
GPT = ["gpt", "--progress=never", "--log-every=4", "--data.num-train=480",
       "--data.num-test=96", "--data.seq-len=16", "--model.dim=24", "--model.layers=2",
       "--model.heads=3", "--model.dropout=0.0", "--model.dtype=float64",
       "--global-batch=16", "--base-batch=16", "--checkpoint-every=6", "--eval-every=100"]
STEPS = 12


@pytest.fixture(scope="module")
def gpt_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("language"))


@pytest.fixture(scope="module")
def single(tmp_path_factory, gpt_cache):
    """The single-rank run every layout must reproduce."""
    run = str(tmp_path_factory.mktemp("single") / "run")
    result = train(1, run, gpt_cache, f"--steps={STEPS}")
    assert result.returncode == 0, result.output
    return run


def train(n, run, cache, *args, timeout=400):
    cmd = [sys.executable, "-m", "mpidl", "train", *GPT, f"--data.cache-dir={cache}",
           f"--run-dir={run}", *args]
    return mpiexec(n, cmd, timeout=timeout)


def losses(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if r["kind"] == "train"]


def accuracies(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r["accuracy"] for r in map(json.loads, f) if r["kind"] == "train"]


def evals(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval"]


def parameters(run, step):
    from mpidl.train.checkpoint import load_checkpoint

    return load_checkpoint(os.path.join(run, "checkpoints", f"checkpoint-{step:08d}.h5"))


def assert_same_model(got, expected, what):
    assert sorted(got.model) == sorted(expected.model), what
    for name, value in expected.model.items():
        numpy.testing.assert_allclose(got.model[name], value, rtol=1e-9, atol=1e-11,
                                      err_msg=f"{what}: {name}")
    for key, value in expected.optimizer.items():
        if hasattr(value, "shape"):
            numpy.testing.assert_allclose(got.optimizer[key], value, rtol=1e-8, atol=1e-13,
                                          err_msg=f"{what}: optimizer {key}")


LAYOUTS = [
    (2, ["--tensor-parallel=2"]),
    (2, ["--tensor-parallel=2", "--megatron-sequence-parallel"]),
    (2, ["--sequence-parallel=ring", "--sequence-parallel-size=2"]),
    (3, ["--sequence-parallel=ulysses"]),            # size: every rank; 3 heads over 3
    (3, ["--tensor-parallel=3"]),
    (3, ["--sequence-parallel=ring"]),
    (4, ["--tensor-parallel=2", "--sequence-parallel=ring"]),           # tensor x sequence
    (4, ["--tensor-parallel=2", "--megatron-sequence-parallel"]),      # data x tensor
    (4, ["--sequence-parallel=ring", "--sequence-parallel-size=2"]),    # data x sequence
    (2, ["--tensor-parallel=2", "--zero=3"]),                           # ZeRO over 1 replica
    (4, ["--tensor-parallel=2", "--zero=1"]),                           # ... over 2
    (4, ["--tensor-parallel=2", "--megatron-sequence-parallel", "--zero=2"]),
    (4, ["--tensor-parallel=2", "--zero=3"]),
    (4, ["--sequence-parallel=ring", "--sequence-parallel-size=2", "--zero=3"]),
]


IDS = [f"{n}-" + "-".join(a.lstrip("-") for a in args) for n, args in LAYOUTS]


@pytest.mark.parametrize("n,layout", LAYOUTS, ids=IDS)
def test_every_layout_trains_the_single_rank_models_steps(tmp_path, gpt_cache, single, n,
                                                          layout):
    run = str(tmp_path / "run")
    result = train(n, run, gpt_cache, f"--steps={STEPS}", *layout)
    assert result.returncode == 0, result.output
    assert "model layout: data" in result.output and "split over data" in result.stdout
    numpy.testing.assert_allclose(losses(run), losses(single), rtol=1e-9)
    assert_same_model(parameters(run, STEPS), parameters(single, STEPS), " ".join(layout))
    ours, theirs = evals(run)[-1], evals(single)[-1]
    assert ours["test_targets"] == theirs["test_targets"]
    assert ours["test_loss"] == pytest.approx(theirs["test_loss"], rel=1e-9)
    # next-token accuracy: the argmax over the vocabulary-split logits, as one rank's
    assert ours["test_accuracy"] == theirs["test_accuracy"]
    assert accuracies(run) == accuracies(single)


def test_mpidl_eval_scores_a_split_run_as_its_training_did(tmp_path, gpt_cache):
    run = str(tmp_path / "run")
    result = train(2, run, gpt_cache, "--steps=6", "--tensor-parallel=2")
    assert result.returncode == 0, result.output
    done = mpiexec(1, [sys.executable, "-m", "mpidl", "eval", run, "--json"], timeout=120)
    assert done.returncode == 0, done.output
    scored = json.loads(done.stdout)
    assert scored["test_loss"] == pytest.approx(evals(run)[-1]["test_loss"], rel=1e-9)
    assert scored["test_targets"] == evals(run)[-1]["test_targets"]
    # a language model has no answer per input: `mpidl predict` says so and points to eval
    refused = mpiexec(2, [sys.executable, "-m", "mpidl", "predict", run, os.devnull],
                      timeout=120)
    assert refused.returncode == 2, refused.output
    assert "is a language model" in refused.stderr and f"mpidl eval {run}" in refused.stderr
    assert scored["test_accuracy"] == evals(run)[-1]["test_accuracy"]


def test_clipping_counts_every_shard_once(tmp_path, gpt_cache):
    args = [f"--steps={STEPS}", "--clip-grad-norm=0.05"]
    whole = str(tmp_path / "whole")
    assert train(1, whole, gpt_cache, *args).returncode == 0
    for n, layout in ((2, ["--tensor-parallel=2"]), (4, ["--tensor-parallel=2", "--zero=2"]),
                      (4, ["--tensor-parallel=2", "--zero=3"])):
        split = str(tmp_path / "-".join(layout))
        result = train(n, split, gpt_cache, *args, *layout)
        assert result.returncode == 0, result.output
        assert_same_model(parameters(split, STEPS), parameters(whole, STEPS), str(layout))


RESUMES = {  # name: (ranks, layout) for steps 1-6, then for steps 7-12
    "tensor-to-ring": ((2, ["--tensor-parallel=2"]), (2, ["--sequence-parallel=ring"])),
    "tensor-to-dp3": ((2, ["--tensor-parallel=2"]), (3, [])),
    "tensor-to-zero3": ((2, ["--tensor-parallel=2"]), (4, ["--tensor-parallel=2", "--zero=3"])),
    "zero2-tensor-to-one-rank": ((4, ["--tensor-parallel=2", "--zero=2"]), (1, [])),
    "one-rank-to-tensor": ((1, []), (2, ["--tensor-parallel=2", "--megatron-sequence-parallel"])),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_checkpoint_resumes_at_another_layout(tmp_path, gpt_cache, single, name):
    """Steps 1-6 at one layout, 7-12 at another: the single-rank run's steps either way."""
    (n1, first), (n2, second) = RESUMES[name]
    run = str(tmp_path / name)
    result = train(n1, run, gpt_cache, f"--steps={STEPS}", "--stop-at-step=6", *first)
    assert result.returncode == 0, result.output
    result = train(n2, run, gpt_cache, f"--steps={STEPS}", *second)
    assert result.returncode == 0, result.output
    assert "resumed from" in result.output
    assert_same_model(parameters(run, STEPS), parameters(single, STEPS), name)


@pytest.mark.parametrize("n,args,says", [
    (2, ["--tensor-parallel=3"], "does not divide the 2 ranks"),
    (2, ["--tensor-parallel=2", "--model.heads=1", "--model.dim=8"],
     "use at most 1 tensor ranks"),
    (2, ["--sequence-parallel=ulysses", "--model.heads=3"], "--sequence-parallel=ring"),
    (4, ["--sequence-parallel=ring", "--data.seq-len=4"], "use at most 3 sequence ranks"),
    (2, ["--sequence-parallel-size=2"], "add --sequence-parallel=ulysses"),
    (1, ["--megatron-sequence-parallel"], "needs --tensor-parallel >= 2"),
])
def test_an_impossible_layout_is_a_configuration_error_saying_what_works(
        tmp_path, gpt_cache, n, args, says):
    run = str(tmp_path / "run")
    result = train(n, run, gpt_cache, "--steps=2", *args, timeout=200)
    assert result.returncode == 2, result.output
    assert says in result.output
    assert not os.path.exists(os.path.join(run, "checkpoints"))


def test_a_layout_for_a_model_that_cannot_be_split_is_refused(tmp_path, cache):
    cmd = [sys.executable, "-m", "mpidl", "train", "reviews", "--steps=2", "--progress=never",
           "--data.num-train=256", "--data.num-test=64", f"--data.cache-dir={cache}",
           f"--run-dir={tmp_path / 'run'}", "--tensor-parallel=2"]
    result = mpiexec(2, cmd, timeout=200)
    assert result.returncode == 2, result.output
    assert "split the gpt model" in result.output
