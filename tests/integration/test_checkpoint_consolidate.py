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


def _saver():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpi",
                        "test_sharded_checkpoint.py")
    spec = importlib.util.spec_from_file_location("_consolidate_saver", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("ranks", [2, 3])
def test_consolidate_under_a_launcher_writes_one_file_once(tmp_path, ranks):
    # Every rank used to write the same OUT.tmp: exit 1, two messages, no file.
    import numpy

    from mpidl.testing import run_ranks
    from mpidl.train import checkpoint as ckpt

    run = tmp_path / "run"
    path = run_ranks(2, _saver().save_at, str(run / "checkpoints"), 3)[0]
    result = mpidl(ranks, "checkpoint", "consolidate", str(run), str(tmp_path / "out.h5"))
    assert result.returncode == 0, result.output
    assert result.stdout.count(" -> ") == 1 and not result.stderr.strip(), result.output
    full, sharded = ckpt.load_checkpoint(str(tmp_path / "out.h5")), ckpt.load_checkpoint(path)
    for name in sharded.model:
        numpy.testing.assert_array_equal(full.model[name], sharded.model[name])
    assert sorted(os.listdir(tmp_path)) == ["out.h5", "run"]  # no .tmp left
    again = mpidl(ranks, "checkpoint", "consolidate", str(run), str(tmp_path / "out.h5"))
    assert again.returncode == 2, again.output  # every rank: rank 0's status, one message
    assert again.stderr.count("out.h5 already exists") == 1, again.output
