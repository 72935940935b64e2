"""`mpidl train` never loses good state silently: divergence, corrupt checkpoints, refused
resumes and full disks end with a clear message and the run directory as it was.

Real jobs under mpiexec, on the small generated corpus (and, for NaN inputs, a dense
dataset written by `mpidl shard --from-npz`).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import h5py
import numpy
import pytest

from mpidl.testing.launch import mpiexec
from trainjob import (EPOCH, SLOW, SMALL, copy_run, evals, final_parameters, train,
                      wait_for_first_record)

pytestmark = [pytest.mark.timeout(300)]


def snapshot(run_dir):
    """Every file of a run directory with its SHA-256: what "left as it was" compares."""
    found = {}
    for root, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, run_dir)] = hashlib.sha256(f.read()).hexdigest()
    return found


def checkpoints(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    return sorted(f for f in os.listdir(d) if f.endswith(".h5"))


@pytest.fixture(scope="module")
def trained(two_epoch_run):
    """A finished 2-epoch run at 2 ranks (conftest.py), to copy per test."""
    return two_epoch_run


# -- divergence ----------------------------------------------------------------------------

def test_divergence_stops_with_status_1_and_keeps_the_good_checkpoints(trained, tmp_path,
                                                                       cache):
    run = copy_run(trained, tmp_path)
    before = {k: v for k, v in snapshot(run).items() if k.startswith("checkpoints")}
    result = train(2, run, cache, "--epochs=4", "--lr=1e6", "--keep-checkpoints=1")
    assert result.returncode == 1, result.output
    assert "non-finite steps in a row" in result.stderr, result.output
    assert "The last good checkpoint is kept: " in result.stderr
    assert "RuntimeWarning" not in result.stderr  # the guard speaks, not NumPy
    after = {k: v for k, v in snapshot(run).items() if k.startswith("checkpoints")}
    assert after == before  # nothing written from the diverged state, nothing rotated away
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert records[-1]["kind"] == "stop" and "non-finite" in records[-1]["reason"]


def test_a_fresh_run_that_diverges_at_once_writes_no_checkpoint(tmp_path, cache):
    run = str(tmp_path / "run")
    result = train(2, run, cache, "--epochs=1", "--lr=1e6", "--nonfinite-steps=3",
                   "--log-every=50")
    assert result.returncode == 1, result.output
    assert "3 non-finite steps in a row" in result.stderr
    assert not os.path.isdir(os.path.join(run, "checkpoints")) or checkpoints(run) == []
    # Stopped before the first train record (the default --log-every): the stop record
    # counts the skipped steps, the warnings' and the last one's.
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["kind"] for r in records] == ["stop"]
    warned = result.stdout.count("the step is skipped on every rank")
    assert records[-1]["skipped_steps"] == warned + 1 >= 3


def _nan_dataset(tmp_path, nan_rows, amplitude=1.0):
    """784-feature rows of 10 separable classes; the rows in ``nan_rows`` hold a NaN."""
    rng = numpy.random.default_rng(0)
    centers = rng.standard_normal((10, 784)).astype(numpy.float32)
    y = rng.integers(0, 10, 640)
    x = (centers[y] + 0.5 * rng.standard_normal((640, 784))).astype(numpy.float32)
    x *= amplitude
    x[nan_rows, 3] = numpy.nan
    path = tmp_path / "arrays.npz"
    numpy.savez(path, x_train=x[:512], y_train=y[:512], x_test=x[512:], y_test=y[512:])
    out = tmp_path / "data"
    done = subprocess.run([sys.executable, "-m", "mpidl", "shard", "--from-npz", str(path),
                           str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return str(out)


def _mlp(tmp_path, data, run, *args, n=2):
    cmd = [sys.executable, "-m", "mpidl", "train", "--task=custom", f"--data={data}",
           "--model=mlp", f"--run-dir={run}", "--global-batch=64", "--progress=never",
           "--log-every=1", *args]
    return mpiexec(n, cmd, timeout=240)


@pytest.mark.parametrize("n", [2, 3])
def test_a_nan_input_on_one_rank_skips_that_step_on_every_rank(tmp_path, n):
    data = _nan_dataset(tmp_path, nan_rows=[100])  # one global batch per epoch holds it
    run = str(tmp_path / "run")
    result = _mlp(tmp_path, data, run, "--epochs=3", "--nonfinite=skip", n=n)
    assert result.returncode == 0, result.output
    assert result.stdout.count("not finite; the step is skipped on every rank") == 3
    assert "non-finite steps skipped: 3" in result.stdout
    assert "differ from rank 0's" not in result.output  # the replicas stayed identical
    step, params = final_parameters(run)
    assert step == 3 * 8 and all(numpy.isfinite(v).all() for v in params.values())
    assert evals(run)[-1]["test_accuracy"] > 0.9
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert max(r.get("skipped_steps", 0) for r in records) == 3


def _summary_table(stdout):
    """The rows of the summary's table (epoch, step, train loss, train acc, test loss, test
    acc) as printed."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["epoch", "step"])
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_a_skip_run_that_diverges_has_a_summary_of_numbers_and_no_nan_in_json(tmp_path):
    data = _nan_dataset(tmp_path, nan_rows=[100])
    run = str(tmp_path / "run")
    # lr 100: the loss grows to ~1e11 (not finite at times), one NaN sample skips steps
    result = _mlp(tmp_path, data, run, "--epochs=2", "--nonfinite=skip", "--lr=100",
                  "--log-every=50")
    assert result.returncode == 0, result.output
    rows = _summary_table(result.stdout)
    assert len(rows) == 2, result.stdout
    for cell in (c for row in rows for c in row[2:]):
        assert cell == "-" or (float(cell) == float(cell) and len(cell) <= 9), rows
    assert "None" not in result.stdout and "RuntimeWarning" not in result.output
    for line in open(os.path.join(run, "metrics.jsonl")):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line}"))


def test_with_the_stop_policy_nan_steps_in_a_row_end_the_run_keeping_the_last_checkpoint(
        tmp_path):
    data = _nan_dataset(tmp_path, nan_rows=list(range(0, 512, 16)))  # every batch
    run = str(tmp_path / "run")
    first = _mlp(tmp_path, data, run, "--epochs=1", "--nonfinite=skip")
    assert first.returncode == 0  # every step skipped, nothing learned, checkpoint written
    # No sample counted: the loss and accuracy are undefined (null), not 0.
    trained = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    trained = [r for r in trained if r["kind"] == "train"]
    assert len(trained) == 8 and all(r["loss"] is None and r["accuracy"] is None
                                     for r in trained), trained
    assert "None" not in first.stdout
    kept = snapshot(os.path.join(run, "checkpoints"))
    result = _mlp(tmp_path, data, run, "--epochs=3", "--nonfinite-steps=2")
    assert result.returncode == 1, result.output
    assert "2 non-finite steps in a row" in result.stderr
    assert snapshot(os.path.join(run, "checkpoints")) == kept


def test_float16_gradients_that_overflow_back_off_the_loss_scale(tmp_path):
    data = _nan_dataset(tmp_path, nan_rows=[], amplitude=30.0)
    run = str(tmp_path / "run")
    # Raw inputs of amplitude 30 (not standardised) are what makes the gradients overflow.
    result = _mlp(tmp_path, data, run, "--epochs=2", "--model.dtype=float16",
                  "--model.sizes=[784, 16, 10]", "--optimizer=sgd", "--lr=0.01",
                  "--model.standardize=false")
    assert result.returncode == 0, result.output
    assert ("float16 gradients overflowed at loss scale 65536; step skipped, scale now 32768"
            in result.stdout), result.stdout
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    scales = [r["loss_scale"] for r in records if r["kind"] == "train"]
    assert scales[0] < 65536 and all(numpy.isfinite(scales))
    _, params = final_parameters(run)
    assert all(v.dtype == numpy.float16 and numpy.isfinite(v).all() for v in params.values())


# -- checkpoint integrity -------------------------------------------------------------------

def _flip_bytes_in_parameters(path, count=4000):
    """Flip bytes inside the largest piece of the checkpoint's first part (its pieces
    are datasets "0", "1", ...; their runs "0.runs", ...)."""
    with h5py.File(path, "r") as f:
        biggest = max((d for n, d in f.items() if not n.endswith(".runs")),
                      key=lambda d: d.size)
        offset = biggest.id.get_offset()
        size = biggest.id.get_storage_size()
    rng = numpy.random.default_rng(1)
    with open(path, "r+b") as f:
        for at in rng.choice(size, count, replace=False):
            f.seek(offset + int(at))
            byte = f.read(1)
            f.seek(offset + int(at))
            f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_newest_checkpoint_is_named_set_aside_and_the_previous_one_resumes(
        trained, tmp_path, cache):
    run = copy_run(trained, tmp_path)
    newest = os.path.join(run, "checkpoints", checkpoints(run)[-1])
    _flip_bytes_in_parameters(newest + ".part-00000")  # found by the rank that reads it
    result = train(2, run, cache, "--epochs=2")
    assert result.returncode == 0, result.output
    assert f"checkpoint part {newest}.part-00000 is corrupt" in result.stdout, result.stdout
    assert "fail their checksum" in result.stdout
    for name in (os.path.basename(newest), os.path.basename(newest) + ".part-00000"):
        assert os.path.exists(os.path.join(run, "checkpoints", "corrupt", name))
    assert f"resumed from {os.path.join(run, 'checkpoints', checkpoints(trained)[0])}" in \
        result.stdout
    # The redone epoch ends where the uninterrupted run ended, bit for bit.
    _, redone = final_parameters(run)
    _, whole = final_parameters(trained)
    for k in whole:
        assert numpy.array_equal(redone[k], whole[k]), k


def test_when_no_checkpoint_loads_the_run_stops_and_changes_nothing(trained, tmp_path, cache):
    run = copy_run(trained, tmp_path)
    for name in checkpoints(run):
        path = os.path.join(run, "checkpoints", name)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    before = snapshot(run)
    result = train(2, run, cache, "--epochs=3")
    assert result.returncode == 2, result.output
    assert result.stderr.count("holds 2 checkpoints and none loads") == 1, result.stderr
    assert "--resume=never" in result.stderr
    assert snapshot(run) == before
    # Asked for explicitly, a fresh start moves the old run aside and trains.
    fresh = train(2, run, cache, "--epochs=1", "--resume=never")
    assert fresh.returncode == 0, fresh.output
    aside = [d for d in os.listdir(run) if d.startswith("previous-")]
    assert len(aside) == 1
    moved = snapshot(os.path.join(run, aside[0]))
    assert moved == {k: v for k, v in before.items()}  # every old file, byte for byte
    assert [r["epoch"] for r in evals(run)] == [0]


def test_resume_never_in_an_unused_directory_just_starts(tmp_path, cache):
    run = str(tmp_path / "run")
    result = train(1, run, cache, "--epochs=1", "--resume=never")
    assert result.returncode == 0, result.output
    assert not [d for d in os.listdir(run) if d.startswith("previous-")]


# -- refused resumes leave the run directory as it was -----------------------------------

@pytest.mark.parametrize("args,message", [
    (["--global-batch=32"], "cannot resume from"),
    (["--model.dim=16"], "holds another model than the configured 'bow'"),
    (["--optimizer=sgd"], "its optimizer state does not fit the configured optimizer 'sgd'"),
])
def test_a_refused_resume_changes_no_file(trained, tmp_path, cache, args, message):
    run = copy_run(trained, tmp_path)
    before = snapshot(run)
    result = train(2, run, cache, "--epochs=3", *args)
    assert result.returncode == 2, result.output
    assert result.stderr.count(message) == 1, result.stderr
    assert os.path.join(run, "checkpoints") in result.stderr  # names the checkpoint
    assert snapshot(run) == before
    evaluated = mpiexec(1, [sys.executable, "-m", "mpidl", "eval", run], timeout=120)
    assert evaluated.returncode == 0 and "test accuracy" in evaluated.stdout, evaluated.output


def test_a_binary_config_file_is_a_configuration_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"\x89HDF\r\n\x1a\n\x00\x00\xff binary")
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "train", str(path)], timeout=60)
    assert result.returncode == 2, result.output
    assert result.stderr.count(f"config file {str(path)!r} is not UTF-8 text") == 1


# Files may not grow past 200 bytes from the moment the trainer first changes the run
# directory (earlier, MPI's shared-memory segments need to grow): a full disk, as far as
# the run directory can tell (EFBIG instead of ENOSPC).
_LIMITED = textwrap.dedent("""
    import resource, signal, sys
    from mpidl.train import trainer
    begin = trainer.Trainer.begin
    def limited(self, *args, **kwargs):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # an EFBIG error instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.RLIM_INFINITY))
        return begin(self, *args, **kwargs)
    trainer.Trainer.begin = limited
    from mpidl.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_full_disk_at_resume_is_named_and_leaves_the_run_directory_as_it_was(
        trained, tmp_path, cache):
    run = copy_run(trained, tmp_path)
    os.remove(os.path.join(run, "checkpoints", checkpoints(run)[-1]))  # resume an epoch back
    before = snapshot(run)
    script = tmp_path / "limited.py"
    script.write_text(_LIMITED)
    cmd = [sys.executable, str(script), "train", *SMALL, f"--data.cache-dir={cache}",
           f"--run-dir={run}", "--epochs=2"]
    result = mpiexec(2, cmd, timeout=120)
    assert result.returncode == 1, result.output
    assert result.stderr.count(f"cannot prepare the run directory {run}") == 1, result.stderr
    assert "File too large" in result.stderr
    assert snapshot(run) == before  # no trimmed metrics, no new config, no .tmp left


# -- stopping a job from its launcher -------------------------------------------------------

@pytest.mark.parametrize("how", ["SIGTERM to mpidl launch", "SIGUSR1 to mpiexec"])
def test_a_signal_to_the_launcher_checkpoints_and_exits_75(tmp_path, cache, how):
    import signal

    from mpidl.testing.launch import mpiexec_command, start

    run = str(tmp_path / "run")
    cmd = mpiexec_command(2, [sys.executable, "-m", "mpidl", "train", *SMALL, *SLOW,
                              f"--data.cache-dir={cache}", f"--run-dir={run}"])
    sig = signal.SIGUSR1
    if how.endswith("mpidl launch"):
        cmd, sig = [sys.executable, "-m", "mpidl", "launch", *cmd[1:]], signal.SIGTERM
    proc = start(cmd)
    try:
        wait_for_first_record(proc, run)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, out + err
    assert "preempted" in out and "exiting with 75" in out, out
    step, _ = final_parameters(run)
    assert 0 < step < 2 * EPOCH, step


def test_evaluating_a_checkpoint_of_another_model_names_it(trained, tmp_path, cache):
    other = str(tmp_path / "other")
    assert train(1, other, cache, "--epochs=1", "--model.dim=16").returncode == 0
    ckpt = os.path.join(trained, "checkpoints", checkpoints(trained)[-1])
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "eval", other, f"--checkpoint={ckpt}"],
                     timeout=120)
    assert result.returncode == 2, result.output
    assert result.stderr.count(f"cannot evaluate {ckpt}: it holds another model") == 1
