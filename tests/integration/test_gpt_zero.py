"""`mpidl train gpt` with and without `--zero`: trains at any rank count, reports its state
per rank, and its sharded checkpoints resume at other rank counts and stages."""
from __future__ import annotations

import json
import os
import sys

import h5py
import numpy
import pytest

from mpidl.testing.launch import mpiexec

pytestmark = [pytest.mark.timeout(400)]

GPT = ["gpt", "--progress=never", "--log-every=5", "--data.num-train=800",
       "--data.num-test=100", "--model.dim=16", "--model.layers=2", "--model.heads=2"]


@pytest.fixture(scope="module")
def gpt_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("language"))


def train(n, run, cache, *args):
    cmd = [sys.executable, "-m", "mpidl", "train", *GPT, f"--data.cache-dir={cache}",
           f"--run-dir={run}", *args]
    return mpiexec(n, cmd, timeout=300)


def records(run, kind):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def parameters(run, step):
    path = os.path.join(run, "checkpoints", f"checkpoint-{step:08d}.h5")
    from mpidl.train.checkpoint import load_checkpoint

    return load_checkpoint(path).model


@pytest.mark.parametrize("n,zero", [(1, 0), (2, 0), (3, 0), (1, 3), (2, 1), (2, 2), (2, 3),
                                    (3, 3)])
def test_gpt_trains_ten_steps_at_any_rank_count(tmp_path, gpt_cache, n, zero):
    run = str(tmp_path / "run")
    result = train(n, run, gpt_cache, "--steps=10", f"--zero={zero}")
    assert result.returncode == 0, result.output
    assert "final test perplexity" in result.stdout and "model state per rank" in result.stdout
    evals = records(run, "eval")
    assert evals and 1 < evals[-1]["test_perplexity"] < 64  # below the uniform guess
    train_records = records(run, "train")
    assert len(train_records[-1]["state_bytes_parameters"]) == n
    assert all("perplexity" in r for r in train_records)


def test_sharded_state_per_rank_falls_with_the_stage(tmp_path, gpt_cache):
    held = {}
    for zero in (0, 1, 2, 3):
        run = str(tmp_path / f"z{zero}")
        assert train(2, run, gpt_cache, "--steps=5", f"--zero={zero}").returncode == 0
        last = records(run, "train")[-1]
        held[zero] = {k: max(last[f"state_bytes_{k}"]) for k in
                      ("parameters", "gradients", "optimizer")}
    full = held[0]["parameters"]
    assert held[1]["optimizer"] <= held[0]["optimizer"] / 2 + 4096
    assert held[3]["parameters"] <= full / 2 + 4096 and held[3]["optimizer"] <= full + 4096


def test_a_checkpoint_moves_from_3_ranks_stage_3_to_2_ranks_stage_2_to_1_rank_plain(
        tmp_path, gpt_cache):
    chain, whole = str(tmp_path / "chain"), str(tmp_path / "whole")
    exact = ["--steps=30", "--model.dtype=float64"]
    for n, zero, stop in ((3, 3, 10), (2, 2, 20), (1, 0, None)):
        args = [*exact, f"--zero={zero}"] + ([f"--stop-at-step={stop}"] if stop else [])
        result = train(n, chain, gpt_cache, *args)
        assert result.returncode == 0, result.output
    assert train(1, whole, gpt_cache, *exact).returncode == 0
    a, b = parameters(chain, 30), parameters(whole, 30)
    for name in b:
        numpy.testing.assert_allclose(a[name], b[name], rtol=1e-9, atol=1e-11, err_msg=name)


def test_a_sharded_run_resumes_bit_for_bit_at_the_same_rank_count(tmp_path, gpt_cache):
    split, whole = str(tmp_path / "split"), str(tmp_path / "whole")
    assert train(2, split, gpt_cache, "--steps=20", "--zero=2",
                 "--stop-at-step=10").returncode == 0
    parts = sorted(os.listdir(os.path.join(split, "checkpoints")))
    assert parts == ["checkpoint-00000010.h5", "checkpoint-00000010.h5.part-00000",
                     "checkpoint-00000010.h5.part-00001"], parts
    assert train(2, split, gpt_cache, "--steps=20", "--zero=2").returncode == 0
    assert train(2, whole, gpt_cache, "--steps=20", "--zero=2").returncode == 0
    a, b = parameters(split, 20), parameters(whole, 20)
    for name in b:
        assert numpy.array_equal(a[name], b[name]), name


def test_a_missing_part_of_a_sharded_checkpoint_is_named(tmp_path, gpt_cache):
    run = str(tmp_path / "run")
    assert train(2, run, gpt_cache, "--steps=20", "--zero=1",
                 "--stop-at-step=10").returncode == 0
    part = os.path.join(run, "checkpoints", "checkpoint-00000010.h5.part-00001")
    os.remove(part)
    result = train(2, run, gpt_cache, "--steps=20", "--zero=1")
    assert result.returncode == 2, result.output
    assert f"lacks 1 of its parts ({part})" in result.stderr


def test_a_data_parallel_checkpoint_resumes_under_zero_and_back(tmp_path, gpt_cache):
    run = str(tmp_path / "run")
    assert train(2, run, gpt_cache, "--steps=15", "--stop-at-step=5").returncode == 0
    assert train(2, run, gpt_cache, "--steps=15", "--zero=3",
                 "--stop-at-step=10").returncode == 0
    result = train(1, run, gpt_cache, "--steps=15")
    assert result.returncode == 0, result.output
    with h5py.File(os.path.join(run, "checkpoints", "checkpoint-00000015.h5")) as f:
        assert f.attrs["format_version"] == 3  # every layout writes the sharded format
    assert sorted(os.listdir(os.path.join(run, "checkpoints")))[-2:] == [
        "checkpoint-00000015.h5", "checkpoint-00000015.h5.part-00000"]
