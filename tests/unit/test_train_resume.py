"""`mpidl train` stopped mid-epoch and resumed, in this process on one rank: the resumed
run reads the rest of the epoch, as the uninterrupted run does (the MPI version, bit for
bit at 2 ranks and across rank counts, is tests/integration/test_train.py)."""
from __future__ import annotations

import os
import signal

import numpy
import pytest

from mpidl.train import latest_checkpoint, load_checkpoint
from mpidl.train.command import main

# 120 reviews in batches of 16: 8 steps, the last one short. A bag of words small enough
# that a run takes a fraction of a second.
TINY = ["--data.num-train=120", "--data.num-test=20", "--data.vocab-size=200",
        "--data.seq-len=16", "--model.dim=8", "--model.hidden=8", "--global-batch=16",
        "--epochs=1", "--progress=never",
        "--keep-freed-memory=false"]  # mallopt is process-wide: not in the test process


@pytest.fixture
def train(tmp_path):
    """``mpidl train`` in this process; restores the signal handlers the command keeps."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}

    def run(run_dir, *args):
        return main([*TINY, f"--data.cache-dir={tmp_path / 'cache'}",
                     f"--run-dir={tmp_path / run_dir}", *args])

    yield run
    for s, handler in saved.items():
        signal.signal(s, handler)


def last_checkpoint(run_dir):
    return load_checkpoint(latest_checkpoint(os.path.join(run_dir, "checkpoints")))


def test_a_run_stopped_mid_epoch_resumes_at_the_next_batch_of_the_epoch(train, tmp_path):
    assert train("whole") == 0
    assert train("split", "--stop-at-step=3") == 0
    assert last_checkpoint(tmp_path / "split").sampler["step"] == 3
    assert train("split") == 0  # resumes from the run directory's checkpoint
    whole, split = last_checkpoint(tmp_path / "whole"), last_checkpoint(tmp_path / "split")
    assert whole.step == split.step == 8
    assert whole.sampler == split.sampler
    assert whole.model.keys() == split.model.keys()
    for name in whole.model:  # the same batches in the same order: the same numbers
        assert numpy.array_equal(whole.model[name], split.model[name]), name


@pytest.mark.parametrize("run_dir, words", [
    ("file", "run directory '{t}/file' is a file, not a directory; name a directory"),
    ("file/run", "run directory '{t}/file/run': '{t}/file' is a file, so no directory can "
                 "be made under it"),
])
def test_a_run_directory_at_or_under_a_file_is_bad_input_before_the_data_is_made(
        train, tmp_path, capsys, run_dir, words):
    (tmp_path / "file").write_text("mine")
    assert train(run_dir) == 2  # was 1, after the data and the model, "free space"
    assert words.format(t=tmp_path) in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()  # no corpus generated
    assert (tmp_path / "file").read_text() == "mine"
