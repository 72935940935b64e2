"""A really full disk while `mpidl train` checkpoints at 2 ranks (#38): the job said
"unhandled exception; aborting" with an h5py traceback and left a .tmp in 3 runs of 5.

The disk is a small tmpfs mounted in a mount namespace of the test's own (``unshare -m``
with private propagation): nobody else sees it, and it goes when the namespace's last
process ends, so the machine is left as it was. That needs root (or user namespaces
with mount rights); elsewhere the test is skipped, saying why. The run directory is
copied out of the namespace before it ends, for the checks and the resume.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from mpidl.testing.launch import launch_env, mpiexec, mpiexec_command
from mpidl.train import checkpoint as ckpt

pytestmark = [pytest.mark.timeout(600)]

GPT = ["gpt", "--progress=never", "--log-every=5", "--data.num-train=400",
       "--data.num-test=50", "--model.dim=64", "--model.layers=2", "--model.heads=2",
       "--zero=1", "--checkpoint-every=2"]
# One checkpoint of this model is about 1.3 MB: the first fits, the second does not.
DISK = "2500k"


def _private_mounts() -> str | None:
    """Why a private tmpfs cannot be mounted here, or None when it can."""
    if shutil.which("unshare") is None:
        return "no unshare (util-linux)"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}"
    return None


def test_a_full_disk_while_checkpointing_is_said_cleanly_and_the_run_resumes(tmp_path):
    why = _private_mounts()
    if why:
        pytest.skip(why)
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    cache = tmp_path / "data"
    train = mpiexec_command(2, [sys.executable, "-m", "mpidl", "train", *GPT,
                                f"--data.cache-dir={cache}", f"--run-dir={disk / 'run'}",
                                "--steps=12"])
    script = (f"mount -t tmpfs -o size={DISK} tmpfs {shlex.quote(str(disk))} || exit 99; "
              f"{shlex.join(train)}; rc=$?; "
              f"cp -a {shlex.quote(str(disk / 'run'))} {shlex.quote(str(kept))}; exit $rc")
    # The data set is made first, on the real disk: only the run directory is short.
    assert mpiexec(1, [sys.executable, "-m", "mpidl", "train", *GPT, "--steps=1",
                       f"--data.cache-dir={cache}", f"--run-dir={tmp_path / 'warm'}"],
                   timeout=300).returncode == 0
    result = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                            capture_output=True, text=True, timeout=400, env=launch_env())
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "No space left on device" in result.stderr, out
    assert "cannot write a checkpoint part" in result.stderr, out
    assert "--keep-checkpoints N needs room for N + 1" in result.stderr, out
    for wrong in ("unhandled exception", "Traceback", "h5py", "MPI_ABORT"):
        assert wrong not in out, out
    names = os.listdir(kept / "checkpoints")
    assert not [n for n in names if n.endswith(".tmp")], names
    good = ckpt.latest_checkpoint(str(kept / "checkpoints"))
    assert good is not None, names
    step = ckpt.load_checkpoint(good).step
    assert 2 <= step < 12
    # No part of the failed checkpoint is left: every part's index is there.
    assert all(n.split(".part-")[0] in names for n in names), names
    # The next run, with room, resumes from the last good checkpoint and finishes.
    resumed = mpiexec(2, [sys.executable, "-m", "mpidl", "train", *GPT, "--steps=12",
                          f"--data.cache-dir={cache}", f"--run-dir={kept}"], timeout=300)
    assert resumed.returncode == 0, resumed.output
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(str(kept / "checkpoints"))).step == 12
