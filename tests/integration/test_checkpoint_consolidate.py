"""`mpidl checkpoint consolidate`: a sharded ZeRO-3 checkpoint becomes one full file that
`mpidl eval` scores exactly as it scores the sharded checkpoint itself."""
from __future__ import annotations

import json
import os
import sys

import pytest

from mpidl.testing.launch import mpiexec

pytestmark = [pytest.mark.timeout(400)]

GPT = ["gpt", "--progress=never", "--log-every=5", "--data.num-train=400",
       "--data.num-test=50", "--model.dim=16", "--model.layers=2", "--model.heads=2"]


def mpidl(n, *args):
    return mpiexec(n, [sys.executable, "-m", "mpidl", *args], timeout=300)


def test_eval_of_the_consolidated_file_equals_eval_of_the_sharded_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    result = mpidl(2, "train", *GPT, f"--data.cache-dir={tmp_path / 'data'}",
                   f"--run-dir={run}", "--steps=6", "--zero=3")
    assert result.returncode == 0, result.output
    sharded = mpidl(2, "eval", run, "--json")
    assert sharded.returncode == 0, sharded.output
    result = mpidl(1, "checkpoint", "consolidate", run)
    assert result.returncode == 0, result.output
    full = os.path.join(run, "consolidated", "checkpoint-00000006.h5")
    assert os.path.isfile(full), result.output
    whole = mpidl(2, "eval", run, f"--checkpoint={full}", "--json")
    assert whole.returncode == 0, whole.output
    a, b = json.loads(sharded.stdout.splitlines()[-1]), json.loads(whole.stdout.splitlines()[-1])
    assert a.pop("checkpoint") != b.pop("checkpoint")
    assert a == b
