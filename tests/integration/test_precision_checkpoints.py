"""Checkpoints of half-precision runs at 2 ranks (#38): a consolidated bf16 ZeRO-3
checkpoint evaluates and resumes (it was written as opaque |V2 that nothing loaded)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from mpidl.testing.launch import mpiexec
from mpidl.train import checkpoint as ckpt

pytestmark = [pytest.mark.timeout(600)]

GPT = ["gpt", "--progress=never", "--log-every=5", "--data.num-train=400",
       "--data.num-test=50", "--model.dim=16", "--model.layers=2", "--model.heads=2"]


def mpidl(n, *args):
    return mpiexec(n, [sys.executable, "-m", "mpidl", *args], timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``make(precision, *layout)``: the run directory of a 6-step 2-rank run, made once."""
    root = tmp_path_factory.mktemp("precision")
    runs = {}

    def make(precision, *layout):
        name = "-".join([precision, *layout]).replace("=", "").replace("-", "")
        if name not in runs:
            run = str(root / name)
            result = mpidl(2, "train", *GPT, f"--data.cache-dir={root / 'data'}",
                           f"--run-dir={run}", "--steps=6", f"--precision={precision}",
                           *layout)
            assert result.returncode == 0, result.output
            runs[name] = run
        return runs[name], root / "data"
    return make


def newest(run):
    return ckpt.load_checkpoint(ckpt.latest_checkpoint(os.path.join(run, "checkpoints")))


def test_a_consolidated_bf16_zero3_checkpoint_evaluates_and_resumes(trained, tmp_path):
    run, cache = trained("bf16", "--zero=3")
    out = str(tmp_path / "out.h5")
    result = mpidl(1, "checkpoint", "consolidate", run, out)
    assert result.returncode == 0, result.output
    full = ckpt.load_checkpoint(out)
    assert {a.dtype.name for a in full.model.values()} == {"bfloat16"}
    sharded = mpidl(2, "eval", run, "--json")
    whole = mpidl(2, "eval", run, f"--checkpoint={out}", "--json")
    assert sharded.returncode == 0 and whole.returncode == 0, sharded.output + whole.output
    a, b = (json.loads(r.stdout.splitlines()[-1]) for r in (sharded, whole))
    assert a.pop("checkpoint") != b.pop("checkpoint") == out
    assert a == b
    resumed = str(tmp_path / "resumed")
    result = mpidl(2, "train", *GPT, f"--data.cache-dir={cache}", f"--run-dir={resumed}",
                   "--steps=8", "--precision=bf16", "--zero=3", f"--resume={out}")
    assert result.returncode == 0, result.output
    assert newest(resumed).step == 8
