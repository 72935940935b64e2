"""Checkpoints of half-precision runs at 2 ranks (#38): a consolidated bf16 ZeRO-3
checkpoint evaluates and resumes (it was written as opaque |V2 that nothing loaded), and
a run resumes in another precision (bf16 -> fp32 was refused as "optimizer state does not
fit the configured optimizer"), across layouts too."""
from __future__ import annotations

import json
import os
import sys

import numpy
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


# Across precisions and layouts: a half run's fp32 masters become the fp32 parameters, an
# fp32 run's parameters the masters (the values are checked in
# tests/unit/test_precision_train.py).
@pytest.mark.parametrize("saved, resumed", [
    (("bf16", "--zero=3"), ("fp32",)),
    (("fp32", "--zero=1"), ("bf16", "--zero=3")),
])
def test_a_run_resumes_in_another_precision(trained, tmp_path, saved, resumed):
    run, cache = trained(*saved)
    path = ckpt.latest_checkpoint(os.path.join(run, "checkpoints"))
    again = str(tmp_path / "again")
    result = mpidl(2, "train", *GPT, f"--data.cache-dir={cache}", f"--run-dir={again}",
                   "--steps=8", f"--precision={resumed[0]}", *resumed[1:],
                   f"--resume={path}")
    assert result.returncode == 0, result.output
    assert "optimizer state does not fit" not in result.output
    state = newest(again)
    assert state.step == 8
    want = "bfloat16" if resumed[0] == "bf16" else "float32"
    assert {a.dtype.name for a in state.model.values()} == {want}
    masters = [k for k in state.optimizer if k.endswith(".master")]
    assert bool(masters) == (resumed[0] == "bf16")
    assert all(numpy.isfinite(numpy.asarray(a, dtype=numpy.float32)).all()
               for a in state.model.values())
