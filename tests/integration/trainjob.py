"""Helpers of the tests that launch `mpidl train`: a small corpus, a launch, the results."""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

from mpidl.testing.launch import mpiexec
from mpidl.train.checkpoint import load_checkpoint

# 6000 reviews, 64 tokens: 94 steps of 64 per epoch, about a second of training.
SMALL = ["--data.num-train=6000", "--data.num-test=2000", "--data.vocab-size=2000",
         "--data.seq-len=64", "--lr=1e-2", "--log-every=4", "--progress=never"]
EPOCH = 94


def train(n, run_dir, cache, *args, timeout=240):
    cmd = [sys.executable, "-m", "mpidl", "train", *SMALL, f"--data.cache-dir={cache}",
           f"--run-dir={run_dir}", *args]
    return mpiexec(n, cmd, timeout=timeout)


def copy_run(run, tmp_path, name="run"):
    """A copy of run directory ``run`` under ``tmp_path`` (for a test that writes into it)."""
    return str(shutil.copytree(run, tmp_path / name))


def final_parameters(run_dir):
    """The step and parameters of the run's newest checkpoint (its parts assembled)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    last = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".h5"))[-1]
    state = load_checkpoint(os.path.join(ckpt_dir, last), "model")
    return state.step, state.model


def evals(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval"]


# A run slow enough (a small transformer, a record per step) to be signalled mid-way.
SLOW = ["--epochs=2", "--model=transformer", "--model.dim=16", "--model.layers=1",
        "--model.heads=2", "--model.ffn=32", "--log-every=1"]


def wait_for_first_record(proc, run_dir, timeout=120):
    """Until the run has written its first metrics record (or its launch has ended)."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            return
        time.sleep(0.02)
