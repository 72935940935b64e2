"""Every command refuses bad input the same way (docs/exit-status.md): exit 2, one
message naming the value, the limit and the fix, before any work, and never a traceback.

One table for all commands. A row is the command line (``{run}``, ``{data}`` and
``{inputs}`` stand for the session's tiny run, its dataset and a directory of bad input
files), what goes to standard input, the expected status and a fragment of the message.
A new command adds its rows: a command without any fails
:func:`test_every_command_has_rows_in_the_table`.
"""
from __future__ import annotations

import os
import shutil
import sys

import h5py
import numpy
import pytest

from hpc.launch import is_open_mpi, mpiexec_path
from mpidl.cli import COMMANDS
from mpidl.testing.launch import launch_env, mpiexec, mpiexec_command, run

pytestmark = [pytest.mark.timeout(120)]

MPIDL = os.path.join(os.path.dirname(sys.executable), "mpidl")  # the console script
TINY_MODEL = ["--task=custom", "--model=mlp", "--model.sizes=[4,8,2]"]
BAD_BYTE, BAD_LINE = 12288, 252  # where latin1.csv holds a byte that is not UTF-8


def mpidl(*args, stdin="", timeout=60, env=None):
    return run([MPIDL, *args], timeout, launch_env(env), input=stdin)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A one-epoch MLP run on 200 rows of 4 features, its dataset, and bad input files."""
    root = tmp_path_factory.mktemp("bad-inputs")
    rng = numpy.random.default_rng(7)
    x = rng.normal(0, 1, (200, 4)).astype(numpy.float32)
    numpy.savez(root / "all.npz", x=x, y=(x[:, 0] > 0).astype(numpy.int64))
    data, run_dir = str(root / "data"), str(root / "run")
    for args in (["shard", "--from-npz", str(root / "all.npz"), data],
                 ["train", *TINY_MODEL, f"--data={data}", "--epochs=1", "--global-batch=32",
                  "--progress=never", f"--run-dir={run_dir}"]):
        result = mpidl(*args, timeout=120)
        assert result.returncode == 0, result.output
    inputs = root / "inputs"
    inputs.mkdir()
    rows = numpy.zeros((3, 4), numpy.float32)
    for name, value in (("nan", numpy.nan), ("inf", numpy.inf)):
        bad = rows.copy()
        bad[1, 2] = value
        numpy.savez(inputs / f"{name}.npz", x=bad)
    numpy.savez(inputs / "huge.npz", x=numpy.full((2, 4), 3.4e38, numpy.float32))
    numpy.savez(inputs / "float64.npz", x=numpy.full((2, 4), 1e39))
    numpy.savez(inputs / "none.npz", x=numpy.zeros((0, 4), numpy.float32))
    numpy.savez(inputs / "objects.npz", x=numpy.array([{"a": 1}], dtype=object))
    (inputs / "garbage.npz").write_bytes(b"not a zip file")
    (inputs / "garbage.bin").write_bytes(b"garbage")
    (inputs / "bad.toml").write_text("epochs = \n")
    (inputs / "empty.csv").write_text("text,label\n")
    # a Latin-1 byte deep in a UTF-8 file: offset 12288, on line 252 (past the first
    # read-ahead block of 8 KiB, and in the second rank's half under mpiexec -n 2)
    lines = "".join(f"review {i:04d} of one stay that was fine enough,{('neg', 'pos')[i % 2]}\n"
                    for i in range(400))
    latin1 = bytearray(("text,label\n" + lines).encode())
    assert latin1[:BAD_BYTE].count(b"\n") + 1 == BAD_LINE and chr(latin1[BAD_BYTE]).isalpha()
    latin1[BAD_BYTE] = 0xE9  # an é in Latin-1, where UTF-8 needs two bytes
    (inputs / "latin1.csv").write_bytes(bytes(latin1))
    with h5py.File(inputs / "target.h5", "w") as f:
        f["x"] = rows
    with h5py.File(inputs / "linked.h5", "w") as f:
        f["x"] = h5py.ExternalLink(str(inputs / "target.h5"), "/x")
    (inputs / "loss.png").write_bytes(b"a plot of mine")
    shutil.copytree(data, inputs / "ds")  # a dataset whose shard is also an --from-h5 input
    profiles = inputs / "profiles" / "network"
    profiles.mkdir(parents=True)
    (profiles / "allreduce-only.toml").write_text(
        'source = "mpidl bench --op allreduce --save-profile allreduce-only"\n'
        "[allreduce]\nalpha_us = 5\nbandwidth_GBps = 1\n")
    return {"run": run_dir, "data": data, "inputs": str(inputs)}


# (command line, standard input, status, message fragment)
ROWS = [
    # -- mpidl itself
    ("nonsense", "", 2, "mpidl: unknown command 'nonsense'"),
    # -- train: the configuration, checked before any data is made
    ("train --epochs=0", "", 2, "config key 'epochs' must be >= 1, got 0"),
    ("train --lr=nan", "", 2, "config key 'lr' must be a finite number > 0"),
    ("train --bucket-mb=inf", "", 2, "config key 'bucket_mb' must be a finite number > 0"),
    ("train --compression=powersgd:0", "", 2,
     "compression 'powersgd:0' is not one of none, fp16, bf16 or powersgd:R"),
    ("train --compression zip", "", 2, "compression 'zip' is not one of none, fp16, bf16"),
    ("train --compression=powersgd:4 --zero=1", "", 2,
     "--compression=powersgd:4 with --zero=1: PowerSGD compresses whole-model data"),
    ("train nonsense", "", 2, "no preset or file named 'nonsense'"),
    ("train {inputs}/bad.toml", "", 2, "is not valid TOML"),
    ("train --model=nonsense", "", 2, "unknown model 'nonsense'"),
    ("train --task=custom", "", 2, "task 'custom' trains on your dataset: pass --data=DIR"),
    ("train --data={inputs}/nowhere", "", 2, "no manifest.json"),
    ("train --data={data} --task=custom --model=mlp --tensor-parallel=2", "", 2,
     "--tensor-parallel and --sequence-parallel split the gpt model"),
    ("train --data={data} --run-dir={inputs}/garbage.bin " + " ".join(TINY_MODEL), "", 2,
     "run directory '{inputs}/garbage.bin' is a file, not a directory"),
    ("train --data={data} --run-dir={inputs}/garbage.bin/run " + " ".join(TINY_MODEL), "", 2,
     "'{inputs}/garbage.bin' is a file, so no directory can be made under it"),
    # -- shard: bad data is bad input (2), as in train, eval and predict
    ("shard", "", 2, "one of the arguments --from-csv"),
    ("shard --from-npz {inputs}/nowhere.npz {inputs}/out", "", 2, "nowhere.npz: no such file"),
    ("shard --from-npz {inputs}/garbage.npz {inputs}/out", "", 2, "not an .npz file"),
    ("shard --from-npz {inputs}/objects.npz {inputs}/out", "", 2,
     "holds an array of Python objects, which mpidl never loads"),
    ("shard --from-h5 {inputs}/linked.h5 {inputs}/out", "", 2, "is an external link"),
    ("shard --from-csv {inputs}/empty.csv --text-col text --label-col label {inputs}/out", "",
     2, "no records"),
    ("shard --from-npz {inputs}/nan.npz --test-fraction 2 {inputs}/out", "", 2,
     "test_fraction 2.0 must be in [0, 1)"),
    ("shard --from-npz {inputs}/nan.npz --seed -1 {inputs}/out", "", 2,
     "argument --seed: '-1' must be an integer >= 0"),
    ("shard --verify {inputs}/nowhere", "", 2, "no such dataset directory"),
    # an OUT_DIR holding a dataset, without --force: refused before the input is read (the
    # garbage input is not what it reports)
    ("shard --from-npz {inputs}/garbage.npz {inputs}/ds", "", 2,
     "{inputs}/ds/train: already holds a dataset (manifest.json, ...); choose another "
     "directory or overwrite it (overwrite=True, `--force`)"),
    ("shard --from-h5 {inputs}/ds/train/shard-00000.h5 --force {inputs}/ds", "", 2,
     "shard-00000.h5 is {inputs}/ds/train/shard-00000.h5, which this command reads: it is "
     "never written over, even with --force; name another OUT_DIR"),
    ("shard --from-npz {inputs}/nan.npz {inputs}/garbage.bin/out", "", 2,
     "OUT_DIR '{inputs}/garbage.bin/out': '{inputs}/garbage.bin' is a file, so no directory "
     "can be made under it; name a path whose parents are directories"),
    # checked before the input is read: the garbage input is not what it reports
    ("shard --from-npz {inputs}/garbage.npz {inputs}/garbage.bin", "", 2,
     "OUT_DIR '{inputs}/garbage.bin' is a file, not a directory; name a directory"),
    ("shard --from-csv {inputs}/latin1.csv --text-col text --label-col label {inputs}/out", "",
     2, f"latin1.csv:{BAD_LINE}: not valid utf-8 text: byte offset {BAD_BYTE} holds b'\\xe9' "
        "(invalid continuation byte); save the file as utf-8"),
    # -- eval
    ("eval {inputs}/nowhere", "", 2, "is '{inputs}/nowhere' a run directory?"),
    ("eval {run} --checkpoint {inputs}/garbage.bin", "", 2,
     "cannot be opened: it is truncated, corrupt or not an HDF5 file"),
    ("eval {run} --data {inputs}/nowhere", "", 2, "no manifest.json"),
    # -- predict
    ("predict {inputs}/nowhere", "", 2, "is '{inputs}/nowhere' a run directory?"),
    ("predict {run}", "", 2, "standard input is empty: no input to classify"),
    ("predict {run}", "0.1\n\n0.2\n", 2, "standard input: line 2 is blank"),
    ("predict {run} --batch 0", "", 2, "argument --batch: '0' must be an integer >= 1"),
    ("predict {run} {inputs}/nan.npz", "", 2, "row 1 of 'x' holds nan at column 2"),
    ("predict {run} {inputs}/inf.npz --json", "", 2, "row 1 of 'x' holds inf at column 2"),
    ("predict {run} {inputs}/float64.npz", "", 2, "holds 1e+39, beyond float32's range"),
    ("predict {run} {inputs}/huge.npz --json", "", 2, "the model's scores for it are not finite"),
    ("predict {run} {inputs}/none.npz", "", 2, "array 'x' has no rows"),
    ("predict {run} {inputs}/garbage.npz", "", 2, "not an .npz file"),
    ("predict {run} {inputs}/nowhere.npz", "", 2, "nowhere.npz: no such file"),
    ("predict {run} {inputs}/linked.h5", "", 2, "mpidl reads only data stored in the input "
                                                "file itself"),
    ("predict {run} {inputs}/nan.npz --checkpoint {inputs}/garbage.bin", "", 2,
     "name another with --checkpoint, or leave it out"),
    # -- plan: every input before anything is measured
    ("plan --tensor-parallel=2", "", 2, "leave out --tensor-parallel=2"),
    ("plan --tensor-parallel 2", "", 2, "leave out --tensor-parallel=2"),
    ("plan gpt --tensor-parallel=2", "", 2, "prices tensor, Ulysses and ring splits"),
    ("plan --device nonsense", "", 2, "no device profile 'nonsense'"),
    ("plan --network nonsense", "", 2, "no network profile 'nonsense'"),
    ("plan --compression=powersgd:x", "", 2,
     "'compression' (--compression): compression 'powersgd:x' is not one of none, fp16"),
    ("plan --ranks 1000000000 --step-time 1", "", 2,
     "1000000000 ranks for a global batch of 64: every rank needs a sample per step"),
    ("plan --ranks 1,2,128", "", 2, "use at most 64 ranks, or a larger --global-batch"),
    ("plan --ranks 0,2", "", 2, "rank counts >= 1, comma-separated"),
    ("plan --step-time -5", "", 2, "argument --step-time: '-5' must be a finite number > 0"),
    ("plan --step-time 0", "", 2, "argument --step-time: '0' must be a finite number > 0"),
    ("plan --step-time nan", "", 2, "argument --step-time: 'nan' must be a finite number > 0"),
    ("plan --step-time inf", "", 2, "argument --step-time: 'inf' must be a finite number > 0"),
    ("plan --epochs -1", "", 2, "argument --epochs: '-1' must be a finite number > 0"),
    ("plan --epochs 0", "", 2, "argument --epochs: '0' must be a finite number > 0"),
    ("plan --samples -100", "", 2, "argument --samples: '-100' must be an integer >= 1"),
    ("plan --samples 0", "", 2, "argument --samples: '0' must be an integer >= 1"),
    ("plan --memory-gb -1", "", 2, "argument --memory-gb: '-1' must be a finite number > 0"),
    ("plan --memory-gb nan", "", 2, "argument --memory-gb: 'nan' must be a finite number > 0"),
    ("plan --ranks-per-node 0", "", 2, "argument --ranks-per-node: '0' must be an integer"),
    ("plan --ranks-per-node -2", "", 2, "argument --ranks-per-node: '-2' must be an integer"),
    ("plan --setup-hours -3", "", 2, "argument --setup-hours: '-3' must be a finite number"),
    ("plan --queue-hours nan", "", 2, "argument --queue-hours: 'nan' must be a finite number"),
    ("plan --json /", "", 2, "argument --json: '/' is a directory"),
    ("plan --plot /nonexist/x.png", "", 2, "the directory /nonexist does not exist"),
    ("plan --sbatch /nonexist/x", "", 2, "the directory /nonexist does not exist"),
    ("plan --json {inputs}/bad.toml", "", 2, "bad.toml already exists; name another file, "
     "or pass --force to write over it"),
    ("plan --step-time 0.1 --data={data} " + " ".join(TINY_MODEL) + " --force --json "
     "{data}/train/manifest.json", "", 2, "manifest.json lies in {data}, which this command "
     "reads: it is never written over, even with --force"),
    ("plan --network allreduce-only --step-time 0.1 --ranks 1,2 --data={data} "
     + " ".join(TINY_MODEL), "", 0,
     "network profile 'allreduce-only' has no numbers for reduce_scatter, allgather: priced "
     "with its allreduce's (measure them with `mpidl bench --op all"),
    # -- bench: the arguments, before MPI
    ("bench --op nonsense", "", 2, "unknown ['nonsense']"),
    ("bench --iters 0", "", 2, "argument --iters: '0' must be an integer >= 1"),
    ("bench --window-s nan", "", 2, "argument --window-s: 'nan' must be a finite number >= 0"),
    ("bench --plot /nonexist/x.png", "", 2, "the directory /nonexist does not exist"),
    ("bench --save-profile ../x", "", 2, "profile name '../x': use a plain name"),
    ("bench --plot {inputs}/bad.toml", "", 2, "bad.toml already exists; name another file, "
     "or pass --force"),
    ("bench --save-profile allreduce-only", "", 2, "allreduce-only.toml already exists"),
    # -- info, demo
    ("info --nonsense", "", 2, "unrecognized arguments: --nonsense"),
    ("demo --nonsense", "", 2, "unrecognized arguments: --nonsense"),
    # -- sbatch
    ("sbatch nonsense", "", 2, "no template 'nonsense'"),
    ("sbatch train_cpu --profile nonsense", "", 2, "no profile 'nonsense'"),
    ("sbatch train_cpu -N 0", "", 2, "argument -N/--nodes: '0' must be an integer >= 1"),
    ("sbatch train_cpu -t soon", "", 2, "--time 'soon' is not a Slurm time"),
    ("sbatch train_cpu -o /nonexist/x", "", 2, "the directory /nonexist does not exist"),
    ("sbatch train_cpu -o {inputs}/bad.toml", "", 2,
     "bad.toml already exists; name another file, or pass --force"),
    # -- export, import
    ("export", "", 2, "the following arguments are required: RUN_DIR|CHECKPOINT, OUT"),
    ("export {inputs}/nowhere {inputs}/x.safetensors", "", 2, "no such checkpoint file"),
    ("export {run} {inputs}/x.pt --format onnx", "", 2, "invalid choice: 'onnx'"),
    ("export {run} {inputs}/bad.toml", "", 2,
     "bad.toml already exists; name another OUT, or pass --force"),
    ("export {run} {run}/checkpoints/x.safetensors --force", "", 2,
     "which this command reads: it is never written over, even with --force"),
    ("export {run} {inputs}/hf --format hf-gpt2", "", 2, "--format hf-gpt2 exports a gpt"),
    ("import hf-gpt2 {inputs}/nowhere {inputs}/imported", "", 2, "has no config.json"),
    ("import hf-gpt2 {inputs} {inputs}/imported", "", 2, "has no config.json"),
    # -- launch
    ("launch", "", 2, "usage: mpidl launch"),
    ("launch --launcher=/nonexist -n 1 true", "", 2, "cannot run the launcher"),
    # -- checkpoint
    ("checkpoint", "", 2, "the following arguments are required: command"),
    ("checkpoint consolidate {inputs}/nowhere", "", 2, "no such checkpoint file, and no "
     "checkpoint that loads in"),
    ("checkpoint consolidate {inputs}/garbage.npz {inputs}/out.h5", "", 2,
     "garbage.npz cannot be opened: it is truncated, corrupt or not an HDF5 file"),
    ("checkpoint consolidate {run} {run}/checkpoints/ --force", "", 2,
     "lies in {run}/checkpoints, which this command reads: it is never written over, even "
     "with --force; name another file"),
    ("checkpoint consolidate {run} {inputs}/bad.toml", "", 2,
     "bad.toml already exists; name another file, or pass --force to write over it"),
    ("checkpoint consolidate {run} {inputs}/bad.toml/x.h5", "", 2,
     "bad.toml is a file, not a directory; name a file in a directory"),
    # -- plot, run
    ("plot", "", 2, "the following arguments are required: run_dir"),
    ("plot {inputs}/nowhere", "", 2, "metrics.jsonl does not exist"),
    ("plot {run} --out {inputs}", "", 2, "loss.png already exists; name another file, or "
     "pass --force"),
    ("run", "", 2, "usage: mpidl run SCRIPT.py"),
    ("run {inputs}/nowhere.py", "", 2, "is not a file; name a Python script"),
]


def _row_id(row):
    return f"{row[0]}|{row[1]!r}" if row[1] else row[0]


@pytest.mark.parametrize("line, stdin, status, fragment", ROWS, ids=map(_row_id, ROWS))
def test_a_bad_input_exits_with_its_status_and_message_and_no_traceback(tiny, line, stdin,
                                                                        status, fragment):
    args = [a.format(**tiny) for a in line.split()]
    env = {"MPIDL_PROFILE_DIR": os.path.join(tiny["inputs"], "profiles")}
    result = mpidl(*args, stdin=stdin, env=env)
    assert result.returncode == status, result.output
    assert fragment.format(**tiny) in result.output, result.output
    assert "Traceback" not in result.output, result.output
    assert "Warning" not in result.stderr, result.stderr  # no NumPy warnings leak
    assert "NaN" not in result.stdout  # a bare NaN is not JSON
    assert result.output.count(": error:") <= 1, result.output  # one message, once


def test_every_command_has_rows_in_the_table():
    tested = {line.split()[0] for line, *_ in ROWS}
    assert set(COMMANDS) <= tested, f"add rows for {sorted(set(COMMANDS) - tested)}"


def test_predict_under_mpiexec_refuses_standard_input_at_once(tiny):
    # Open MPI 5's launcher never forwards standard input: rank 0 would wait forever.
    # (Other launchers forward it to rank 0, which reads it and shares it.)
    if not is_open_mpi(mpiexec_path()):
        pytest.skip("the launcher is not Open MPI's")
    result = mpiexec(2, [MPIDL, "predict", tiny["run"]], timeout=60)
    assert result.returncode == 2, result.output
    assert result.stderr.count("mpidl predict: error: standard input does not reach rank "
                               "0") == 1, result.output
    assert "pass the inputs as a file" in result.stderr and "Traceback" not in result.output


# Rows whose message must not depend on the rank count: run again at 2 ranks, where shard
# converts in parallel (each rank writes into OUT_DIR, each reads its own bytes of a CSV)
# and train's ranks each write their pieces of a checkpoint into the run directory.
TWO_RANKS = [
    ("shard --from-npz {inputs}/nan.npz {inputs}/garbage.bin/out",
     "'{inputs}/garbage.bin' is a file, so no directory can be made under it"),
    ("shard --from-csv {inputs}/latin1.csv --text-col text --label-col label {inputs}/out",
     f"latin1.csv:{BAD_LINE}: not valid utf-8 text: byte offset {BAD_BYTE} holds b'\\xe9'"),
    ("train --data={data} --run-dir={inputs}/garbage.bin " + " ".join(TINY_MODEL),
     "run directory '{inputs}/garbage.bin' is a file, not a directory"),
]


@pytest.mark.parametrize("line, fragment", TWO_RANKS, ids=[r[0] for r in TWO_RANKS])
def test_at_two_ranks_a_bad_output_path_or_byte_is_the_same_one_message(tiny, line, fragment):
    args = [a.format(**tiny) for a in line.split()]
    result = mpiexec(2, [MPIDL, *args], timeout=90)
    assert result.returncode == 2, result.output
    assert fragment.format(**tiny) in result.stderr, result.output
    assert result.output.count(": error:") == 1 and "Traceback" not in result.output, \
        result.output


def _read_only_mount(tmp_path):
    """A command prefix that runs its command with a read-only filesystem mounted on
    ``tmp_path/ro``, in a user and mount namespace of its own (nothing to undo, and real
    for root, whom no permission bit stops); None where the kernel allows no such
    namespace."""
    ro = tmp_path / "ro"
    ro.mkdir()
    prefix = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
              'mount -t tmpfs -o ro,size=1m mpidl-ro "$0" && exec "$@"', str(ro)]
    try:
        probe = run([*prefix, "sh", "-c", f"! touch {ro}/x 2>/dev/null"], 30)
    except OSError:
        return None
    return prefix if probe.returncode == 0 else None


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("line, fragment", [
    ("shard --from-npz {inputs}/nan.npz {ro}/data", "OUT_DIR '{ro}/data': the directory "
     "'{ro}' cannot be written (Read-only file system); name a directory on a filesystem you "
     "can write"),
    ("shard --from-npz {inputs}/nan.npz {ro}", "OUT_DIR '{ro}': the directory '{ro}' cannot "
     "be written (Read-only file system)"),
    ("train --data={data} --run-dir={ro}/run " + " ".join(TINY_MODEL),
     "run directory '{ro}/run': the directory '{ro}' cannot be written (Read-only file "
     "system)"),
], ids=["shard-under-it", "shard-into-it", "train-run-dir"])
def test_an_output_on_a_read_only_filesystem_is_refused_before_any_work(tiny, tmp_path, ranks,
                                                                        line, fragment):
    prefix = _read_only_mount(tmp_path)
    if prefix is None:
        pytest.skip("no user and mount namespace here (unshare) to mount a read-only "
                    "filesystem in")
    names = {**tiny, "ro": str(tmp_path / "ro")}
    args = [MPIDL, *(a.format(**names) for a in line.split())]
    command = [*prefix, *(mpiexec_command(ranks, args) if ranks > 1 else args)]
    result = run(command, 90, launch_env())
    assert result.returncode == 2, result.output
    assert fragment.format(**names) in result.stderr, result.output
    assert result.output.count(": error:") == 1 and "Traceback" not in result.output, \
        result.output
