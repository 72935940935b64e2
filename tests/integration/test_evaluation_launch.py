"""`mpidl train --zero=3` evaluates a test split whose last batch leaves ranks without
samples, and `mpidl eval` of the run agrees with its eval record to the last count.

513 test samples in global batches of 512: the last batch is one sample, on rank 0, so
at 3 ranks ranks 1 and 2 have empty shares. ZeRO-3's forward gathers parameters from
every rank, and the trainer's evaluation used to skip an empty share: the job hung until
the watchdog aborted it (status 124 after MPIDL_TIMEOUT).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from mpidl.testing.launch import mpiexec

pytestmark = [pytest.mark.timeout(240)]

TASKS = {
    "reviews": ["reviews", "--data.num-train=300", "--data.vocab-size=300",
                "--data.seq-len=16"],
    "gpt": ["gpt", "--data.num-train=200", "--model.dim=16", "--model.layers=1",
            "--model.heads=2"],
}
EXACT = {  # the fields that are counts, or ratios of counts: equal to the last bit
    "reviews": ("test_accuracy", "majority_accuracy", "macro_f1", "recall"),
    "gpt": ("test_targets", "test_accuracy"),
}
HANG = {"MPIDL_TIMEOUT": "30"}  # a hang aborts the job (124) well inside the test's limit


@pytest.mark.parametrize("task", ["reviews", "gpt"])
def test_zero_3_evaluation_with_ranks_left_empty_finishes_and_mpidl_eval_agrees(
        tmp_path, task):
    run, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    trained = mpiexec(3, [sys.executable, "-m", "mpidl", "train", *TASKS[task],
                          "--data.num-test=513", "--steps=3", "--zero=3", "--progress=never",
                          f"--data.cache-dir={cache}", f"--run-dir={run}"],
                      timeout=120, env=HANG)
    assert trained.returncode == 0, trained.output
    with open(os.path.join(run, "metrics.jsonl")) as f:
        record = [r for r in map(json.loads, f) if r["kind"] == "eval"][-1]

    scored = mpiexec(3, [sys.executable, "-m", "mpidl", "eval", run, "--json"], timeout=120,
                     env=HANG)
    assert scored.returncode == 0, scored.output
    shown = json.loads(scored.stdout.strip().splitlines()[-1])
    for key in EXACT[task]:
        assert shown[key] == record[key], (key, shown[key], record[key])
    assert shown["test_loss"] == pytest.approx(record["test_loss"], rel=1e-6)
