"""`mpidl train` end to end under mpiexec: accuracy, bit-exact resume, preemption, errors.

Each test launches real MPI jobs (subprocesses with wall-clock limits) on a small
generated reviews corpus, shared by the tests of this module.
"""
from __future__ import annotations

import json
import re
import os
import signal
import sys

import numpy
import pytest
from trainjob import (EPOCH, SLOW, SMALL, copy_run, evals, final_parameters, train,
                      wait_for_first_record)

from hpc.launch import process_rank
from mpidl.testing import tolerance
from mpidl.testing.launch import mpiexec, mpiexec_command, start

pytestmark = [pytest.mark.timeout(300)]


# Two runs several tests compare with, made once (each about 12 s at 2 ranks on the 2-core
# CI machine) and copied where a test writes into its run directory.
@pytest.fixture(scope="module")
def whole(two_epoch_run):
    """An uninterrupted 2-epoch run at 2 ranks (conftest.py; shared with other files)."""
    return two_epoch_run


@pytest.fixture(scope="module")
def half(tmp_path_factory, cache):
    """The same run at 2 ranks stopped at the end of its first epoch."""
    run = str(tmp_path_factory.mktemp("half") / "run")
    result = train(2, run, cache, "--epochs=2", f"--stop-at-step={EPOCH}")
    assert result.returncode == 0, result.output
    assert f"stopped at step {EPOCH}" in result.stdout
    return run


@pytest.mark.parametrize("ranks", [1, 2])
def test_default_job_reaches_its_accuracy(tmp_path, cache, ranks):
    run = str(tmp_path / "run")
    result = train(ranks, run, cache, "--epochs=2", "--trace")
    assert result.returncode == 0, result.output
    records = evals(run)
    assert [r["epoch"] for r in records] == [0, 1]
    assert records[-1]["test_accuracy"] >= 0.9, records
    assert re.search(rf"^ranks: +{ranks}$", result.stdout, re.M), result.stdout
    assert "final test accuracy" in result.stdout
    assert result.stdout.count("--- config ---") == 1  # printed by rank 0 only
    for name in ("config.toml", "metrics.jsonl"):
        assert os.path.exists(os.path.join(run, name))
    with open(os.path.join(run, "trace.json")) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert {e["pid"] for e in spans} == set(range(ranks))  # every rank's timeline
    tracks = {e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"compute", "communication", "input"} <= names or len(tracks) >= 2, names


def test_stopped_and_resumed_run_equals_an_uninterrupted_run_bit_for_bit(tmp_path, cache,
                                                                            whole, half):
    split = copy_run(half, tmp_path, "split")  # stopped at EPOCH, said so (the fixture)
    second = train(2, split, cache, "--epochs=2")  # resumes automatically from the run dir
    assert second.returncode == 0, second.output
    assert "resumed from" in second.stdout
    step_a, a = final_parameters(whole)
    step_b, b = final_parameters(split)
    assert step_a == step_b == 2 * EPOCH
    assert a.keys() == b.keys()
    for k in a:
        assert numpy.array_equal(a[k], b[k]), f"{k} differs after resume"
    assert [r["test_accuracy"] for r in evals(whole)] == [r["test_accuracy"] for r in evals(split)]
    # The stop fell between two train records (every 4 steps, 94 % 4 == 2): the resumed
    # run's next record still averages all 4 steps (summed in another order: rounding).
    trains = [[(r["step"], r["loss"]) for r in map(json.loads, open(
        os.path.join(run, "metrics.jsonl"))) if r["kind"] == "train"] for run in (whole, split)]
    assert [s for s, _ in trains[0]] == [s for s, _ in trains[1]]
    numpy.testing.assert_allclose([v for _, v in trains[1]], [v for _, v in trains[0]],
                                  rtol=1e-6)


def test_resume_with_dropout_after_uneven_batches_is_bit_for_bit(tmp_path, cache):
    # 1001 samples in batches of 64: the last batch of an epoch splits 21/20 over the
    # ranks, which then draw different numbers of dropout masks: their generators part.
    tiny = ["--model=transformer", "--model.dim=16", "--model.ffn=32", "--model.layers=1",
            "--model.heads=2", "--model.dropout=0.1", "--data.num-train=1001",
            "--data.num-test=200", "--data.vocab-size=500", "--data.seq-len=32", "--epochs=2"]
    whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
    assert train(2, whole, cache, *tiny).returncode == 0
    assert train(2, split, cache, *tiny, "--stop-at-step=16").returncode == 0
    resumed = train(2, split, cache, *tiny)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.output
    (step_a, a), (step_b, b) = final_parameters(whole), final_parameters(split)
    assert step_a == step_b == 32
    for k in a:
        assert numpy.array_equal(a[k], b[k]), f"{k} differs after resume"


def test_rewinding_to_an_older_checkpoint_sets_the_abandoned_branch_aside(tmp_path, cache,
                                                                         whole):
    run = copy_run(whole, tmp_path)  # checkpoints at 94, 188
    ckpts = os.path.join(run, "checkpoints")
    rewound = train(2, run, cache, "--epochs=2", f"--resume={ckpts}/checkpoint-00000094.h5",
                    "--checkpoint-every=50", "--stop-at-step=150")
    assert rewound.returncode == 0, rewound.output
    assert "moved to" in rewound.stdout, rewound.output
    files = sorted(os.listdir(ckpts))
    aside = [f for f in files if f.startswith("abandoned-after-00000094-")]
    assert len(aside) == 1 and sorted(os.listdir(os.path.join(ckpts, aside[0]))) == \
        ["checkpoint-00000188.h5", "checkpoint-00000188.h5.part-00000"]  # with its part
    assert [f for f in files if f.endswith(".h5")][-1] == "checkpoint-00000150.h5"
    again = train(2, run, cache, "--epochs=2")  # continues the new branch
    assert again.returncode == 0 and "at step 150" in again.stdout, again.output


def test_a_fresh_start_drops_the_records_of_a_job_that_died_before_a_checkpoint(tmp_path,
                                                                                cache):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(  # steps 4-6 of a job killed mid-line, no checkpoint
        "".join(f'{{"kind": "train", "epoch": 0, "step": {s}, "loss": 9.0}}\n'
                for s in (4, 5)) + '{"kind": "train", "epoch": 0, "st')
    result = train(2, str(run), cache, "--steps=8")
    assert result.returncode == 0, result.output
    steps = [r["step"] for r in map(json.loads, open(run / "metrics.jsonl"))
             if r["kind"] == "train"]
    assert steps == [4, 8], steps  # this run's records (every 4 steps), nothing else


@pytest.mark.parametrize("first_ranks, then_ranks", [(2, 1), (1, 3)])
def test_resume_on_a_different_number_of_ranks(request, tmp_path, cache, first_ranks,
                                               then_ranks):
    if first_ranks == 2:  # the module's runs at 2 ranks
        whole = request.getfixturevalue("whole")
        split = copy_run(request.getfixturevalue("half"), tmp_path, "split")
    else:
        whole, split = str(tmp_path / "whole"), str(tmp_path / "split")
        assert train(first_ranks, whole, cache, "--epochs=2").returncode == 0
        assert train(first_ranks, split, cache, "--epochs=2",
                     f"--stop-at-step={EPOCH}").returncode == 0
    resumed = train(then_ranks, split, cache, "--epochs=2")
    assert resumed.returncode == 0, resumed.output
    assert f"now {then_ranks}" in resumed.stdout
    _, a = final_parameters(whole)
    _, b = final_parameters(split)
    rtol, atol = tolerance("float32")
    for k in a:  # float sums in another order: equal up to rounding, not bitwise
        numpy.testing.assert_allclose(b[k], a[k], rtol=100 * rtol, atol=100 * atol, err_msg=k)


@pytest.mark.parametrize("change", ["--global-batch=128", "--data.shuffle=full"])
def test_resuming_with_another_sample_order_is_refused(tmp_path, cache, change):
    # Either one changes which samples the rest of the epoch reads: some would be read
    # twice and others never, silently.
    run = str(tmp_path / "run")
    assert train(2, run, cache, "--stop-at-step=5").returncode == 0
    resumed = train(2, run, cache, change)
    assert resumed.returncode == 2, resumed.output  # a configuration error: one message
    key, value = {"--global-batch=128": ("global_batch", 64),
                  "--data.shuffle=full": ("shuffle", "'block'")}[change]
    assert resumed.stderr.count(f"the checkpoint was written with {key}={value}") == 1
    assert "cannot resume from" in resumed.stderr and "checkpoint-00000005.h5" in resumed.stderr
    assert "Traceback" not in resumed.stderr, resumed.stderr


def test_a_resume_file_that_is_not_there_is_a_config_error(tmp_path, cache):
    missing = str(tmp_path / "nowhere" / "checkpoint-00000020.h5")
    result = train(2, str(tmp_path / "run"), cache, f"--resume={missing}")
    assert result.returncode == 2, result.output
    assert result.stderr.count("mpidl train: error:") == 1 and missing in result.stderr
    assert "Traceback" not in result.stderr


def _rank_pid(marker, rank):
    """The pid of the python process of ``rank`` whose command line contains ``marker``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if os.path.basename(argv[0].decode()).startswith("python") and \
                    any(marker.encode() in a for a in argv):
                if process_rank(int(pid)) == rank:
                    return int(pid)
        except OSError:
            continue
    return None


def test_sigterm_to_one_rank_checkpoints_and_exits_cleanly_then_resumes_exactly(tmp_path, cache):
    whole, run = str(tmp_path / "whole"), str(tmp_path / "preempted")
    assert train(2, whole, cache, *SLOW).returncode == 0
    cmd = mpiexec_command(2, [sys.executable, "-m", "mpidl", "train", *SMALL, *SLOW,
                              f"--data.cache-dir={cache}", f"--run-dir={run}"])
    proc = start(cmd)
    try:
        wait_for_first_record(proc, run)
        pid = _rank_pid(run, 1)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, out + err
    assert "preempted" in out and "exiting with 75" in out
    step, _ = final_parameters(run)
    assert 0 < step < 2 * EPOCH, step
    resumed = train(2, run, cache, *SLOW)
    assert resumed.returncode == 0, resumed.output
    _, a = final_parameters(whole)
    _, b = final_parameters(run)
    for k in a:
        assert numpy.array_equal(a[k], b[k]), f"{k} differs after preemption and resume"


_SIGNAL_AT_STEP = """
import os, signal, sys
from mpidl.train.step import TrainStep
at, train_step = int(os.environ["SIGNAL_AT_STEP"]), TrainStep.__call__
def step(self, x, y, n, index, flag=None):  # rank 0 gets SIGUSR1 while it runs step `at`,
    if index == at and self.run.comm.rank == 0:  # as from Slurm
        os.kill(os.getpid(), signal.SIGUSR1)
    return train_step(self, x, y, n, index, flag)
TrainStep.__call__ = step
from mpidl.cli import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.parametrize("at", [EPOCH - 1, 2 * EPOCH - 1], ids=["epoch-end", "last-step"])
def test_a_preemption_at_an_epochs_last_step_keeps_its_evaluation(tmp_path, cache, at):
    script = tmp_path / "train_signalled.py"
    script.write_text(_SIGNAL_AT_STEP)
    run = str(tmp_path / "run")
    args = [*SMALL, f"--data.cache-dir={cache}", f"--run-dir={run}", "--epochs=2"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"SIGNAL_AT_STEP": str(at),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    first = mpiexec(2, [sys.executable, str(script), *args], timeout=240, env=env)
    assert first.returncode == 75, first.output
    assert [(r["epoch"], r["step"]) for r in evals(run)] == \
        [(e, (e + 1) * EPOCH) for e in range(at // EPOCH + 1)]
    resumed = train(2, run, cache, "--epochs=2")
    assert resumed.returncode == 0, resumed.output
    assert [(r["epoch"], r["step"]) for r in evals(run)] == [(0, EPOCH), (1, 2 * EPOCH)]


@pytest.mark.parametrize("args, message", [
    (["--epochz=3"], "unknown config key 'epochz'"),
    (["--epochs=three"], "'epochs'"),
    (["/nonexistent/run.toml"], "/nonexistent/run.toml"),
    (["--model=transformer", "--model.dimm=64"], "did you mean 'model.dim'"),
    (["--model=bowx"], "unknown model 'bowx'"),
    (["--lr=inf"], "'lr' must be a finite number > 0"),
])
def test_config_errors_give_one_message_and_exit_2_on_every_rank(tmp_path, args, message):
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "train", *args,
                         f"--run-dir={tmp_path / 'run'}"], timeout=60)
    assert result.returncode == 2, result.output
    assert result.stderr.count("mpidl train: error:") == 1, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("names, n_train, message", [
    (("tokens", "label"), 40, "has features ['label', 'tokens'], but the trainer reads 'x'"),
    (("x", "y"), 0, "has no samples: nothing to train on"),
])
def test_a_custom_dataset_the_trainer_cannot_use_is_named_on_every_rank(
        tmp_path, names, n_train, message):
    from mpidl.data import write_shards

    rng = numpy.random.default_rng(0)
    data = str(tmp_path / "data")
    arrays = {names[0]: rng.integers(0, 50, (n_train, 8)).astype(numpy.int32),
              names[1]: rng.integers(0, 2, n_train)}
    test = {names[0]: rng.integers(0, 50, (10, 8)).astype(numpy.int32),
            names[1]: rng.integers(0, 2, 10)}
    write_shards(data, arrays, test_arrays=test)
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "train", "--task=custom",
                         f"--data={data}", f"--run-dir={tmp_path / 'run'}", "--progress=never",
                         "--model.vocab=50"], timeout=120)
    assert result.returncode != 0, result.output
    assert message in result.stderr and os.path.join(data, "train") in result.stderr, \
        result.output


def test_eval_command_scores_the_latest_checkpoint(tmp_path, whole):
    run = copy_run(whole, tmp_path)
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "eval", run], timeout=120)
    assert result.returncode == 0, result.output
    accuracy = float(result.stdout.split("test accuracy:")[1].split()[0])
    assert abs(accuracy - evals(run)[-1]["test_accuracy"]) < 1e-9


def test_real_review_sentences_shard_and_train_through_the_cli(tmp_path, sentiment_sentences):
    """The path a user takes with a real corpus: mpidl shard, then mpidl train --data."""
    corpus = tmp_path / "all.tsv"
    corpus.write_text("".join((sentiment_sentences / f"{name}.tsv").read_text()
                              for name in ("imdb", "amazon", "yelp")))
    data, run = str(tmp_path / "data"), str(tmp_path / "run")
    shard = mpiexec(1, [sys.executable, "-m", "mpidl", "shard", "--from-csv", str(corpus),
                        "--no-header", "--text-col", "0", "--label-col", "1",
                        "--test-fraction", "0.2", "--length", "48", data], timeout=120)
    assert shard.returncode == 0, shard.output
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "train", f"--data={data}",
                         "--epochs=10", "--global-batch=32", "--lr=5e-3", "--progress=never",
                         f"--run-dir={run}"], timeout=240)
    assert result.returncode == 0, result.output
    assert evals(run)[-1]["test_accuracy"] >= 0.7  # 3000 real sentences: about 0.8
