"""`mpidl export` and `mpidl import` as users run them: a ZeRO-3 gpt trained at 2 ranks,
exported from its sharded checkpoint, read back, and brought in again as a run that
`mpidl train` fine-tunes at 2 ranks with ZeRO-3 (resharded at its first resume) and `mpidl eval` scores. The peers' own readers
(transformers, PyTorch, safetensors) are in tests/unit/test_interop_peers.py."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy
import pytest

from mpidl.interop import safetensors
from mpidl.testing.launch import mpiexec
from mpidl.train.checkpoint import load_checkpoint

pytestmark = [pytest.mark.timeout(400)]

GPT = ["gpt", "--progress=never", "--data.num-train=400", "--data.num-test=64",
       "--model.dim=16", "--model.layers=2", "--model.heads=2"]


def mpidl(*args):
    return subprocess.run([sys.executable, "-m", "mpidl", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def test_a_zero3_gpt_leaves_through_export_and_comes_back_to_be_fine_tuned(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "z3"
    trained = mpiexec(2, [sys.executable, "-m", "mpidl", "train", *GPT, "--zero=3",
                          "--steps=6", f"--data.cache-dir={cache}", f"--run-dir={run}"],
                      timeout=300)
    assert trained.returncode == 0, trained.output
    [index] = sorted((run / "checkpoints").glob("checkpoint-*.h5"))
    assert sorted((run / "checkpoints").glob("*.part-*"))  # sharded: one part per rank
    whole = load_checkpoint(index).model  # assembled by mpidl's own reader

    done = mpidl("export", run, tmp_path / "m.safetensors")
    assert done.returncode == 0, done.stderr
    exported = safetensors.load(tmp_path / "m.safetensors")
    assert set(exported) == set(whole)
    for name, value in whole.items():
        assert exported[name].tobytes() == numpy.asarray(value).tobytes(), name
    again = mpidl("export", run, tmp_path / "m.safetensors")
    assert again.returncode == 2 and "--force" in again.stderr

    hf = tmp_path / "hf"
    assert mpidl("export", run, hf, "--format", "hf-gpt2").returncode == 0
    config = json.loads((hf / "config.json").read_text())
    assert (config["n_embd"], config["n_layer"], config["n_head"]) == (16, 2, 2)

    tuned = tmp_path / "tuned"
    brought = mpidl("import", "hf-gpt2", hf, tuned, "gpt", "--data.num-train=400",
                    "--data.num-test=64", f"--data.cache-dir={cache}", "--progress=never")
    assert brought.returncode == 0, brought.stderr
    start = load_checkpoint(tuned / "checkpoints" / "checkpoint-00000000.h5").model
    for name, value in whole.items():
        numpy.testing.assert_array_equal(start[name], value)
    fine = mpiexec(2, [sys.executable, "-m", "mpidl", "train", str(tuned / "config.toml"),
                       f"--run-dir={tuned}", "--steps=4", "--zero=3"], timeout=300)
    assert fine.returncode == 0, fine.output
    assert "resumed from" in fine.stdout and "checkpoint-00000000.h5" in fine.stdout
    scored = mpiexec(2, [sys.executable, "-m", "mpidl", "eval", str(tuned)], timeout=300)
    assert scored.returncode == 0, scored.output
    assert "perplexity" in scored.stdout
