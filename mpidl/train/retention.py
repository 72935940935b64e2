"""Checkpoint files on disk: their names, listing, rotation, and setting them aside.

A run's checkpoints are ``RUN_DIR/checkpoints/checkpoint-<step:08d>.h5`` (with, for a
sharded one, each rank's part beside it: ``.rank-<r>`` or ``.part-<r>``). Nothing here
reads a checkpoint's contents (:mod:`mpidl.train.checkpoint` does): files are listed by
name, kept or removed (:func:`keep_last`), and moved aside, never deleted, when they
failed to load (:func:`set_aside_corrupt`), belong to an abandoned branch of the run
(:func:`set_aside_after`) or to an earlier run (:func:`set_aside_run`). Call these on
one rank.
"""
from __future__ import annotations

import os
import re
import time

from mpidl.train.checkpoint_file import _fsync_dir

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt"     # under CHECKPOINT_DIR: files that failed to load, set aside
_NAME_RE = re.compile(r"^checkpoint-(\d+)\.h5$")


def companions(path: str) -> list[str]:
    """The other ranks' parts of the checkpoint at ``path`` (a sharded one), existing."""
    directory, name = os.path.split(path)
    if not os.path.isdir(directory or "."):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory or ".")
                  if (n.startswith(name + ".rank-") or n.startswith(name + ".part-"))
                  and not n.endswith(".tmp"))


def _move(path: str, target_dir: str, suffix: str = "") -> str:
    """Move a checkpoint and its parts into ``target_dir``; return the new path."""
    target = os.path.join(target_dir, os.path.basename(path) + suffix)
    for part in companions(path):
        os.replace(part, os.path.join(target_dir, os.path.basename(part) + suffix))
    os.replace(path, target)
    return target


def listed_checkpoints(directory: str | os.PathLike) -> list[str]:
    """The checkpoint files in ``directory``, oldest first (whether they load or not)."""
    return [path for _, path in _listed(os.fspath(directory))]


def _listed(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the checkpoint files in ``directory`` by step (``.tmp`` ignored)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME_RE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def set_aside_corrupt(paths: list[str]) -> list[str]:
    """Move checkpoint files that failed to load into ``corrupt/`` beside them; return
    the new paths. Never deleted: a damaged file may still be worth a look, and its
    place must not make it the "latest" again. Call it on one rank."""
    moved = []
    for path in paths:
        directory = os.path.join(os.path.dirname(path), CORRUPT_DIR)
        os.makedirs(directory, exist_ok=True)
        suffix = ""
        if os.path.exists(os.path.join(directory, os.path.basename(path))):
            suffix = f".{time.strftime('%Y%m%d-%H%M%S')}"
        moved.append(_move(path, directory, suffix))
    if moved:
        _fsync_dir(os.path.dirname(paths[0]))
    return moved


def keep_last(directory: str | os.PathLike, k: int) -> list[str]:
    """Delete all but the ``k`` newest checkpoints (with their parts), stale ``.tmp``
    files and parts whose checkpoint was never written (a job killed between the two);
    return them. Call it on the writing rank, after :func:`save_checkpoint`.
    """
    if k < 1:
        raise ValueError(f"keep_last: k must be >= 1, got {k}")
    directory = os.fspath(directory)
    listed = _listed(directory)
    removed = [path for _, path in listed[: max(0, len(listed) - k)]]
    removed += [part for path in list(removed) for part in companions(path)]
    if os.path.isdir(directory):
        names = set(os.listdir(directory))
        removed += [os.path.join(directory, n) for n in names
                    if (n.endswith(".tmp") and _NAME_RE.match(n.split(".h5")[0] + ".h5"))
                    or (".h5.rank-" in n and n.split(".rank-")[0] not in names)
                    or (".h5.part-" in n and n.split(".part-")[0] not in names)]
    for path in removed:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    return removed


def set_aside_after(directory: str | os.PathLike, step: int) -> str | None:
    """Move the checkpoints of steps after ``step`` into a subdirectory; return it.

    A run resumed from an older checkpoint starts a new branch: the newer checkpoints
    belong to the one abandoned, and left in place they would be the ``latest`` that a
    plain rerun resumes from, and the ones ``keep_last`` keeps instead of the new
    branch's. Moved, not deleted: they are someone's results. Call it on one rank.
    """
    directory = os.fspath(directory)
    newer = [path for s, path in _listed(directory) if s > step]
    if not newer:
        return None
    aside = os.path.join(directory, f"abandoned-after-{int(step):08d}-"
                                    f"{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside, exist_ok=True)
    for path in newer:
        _move(path, aside)
    _fsync_dir(directory)
    return aside


# The description of the run's training data (mpidl.data.description), written at the
# start of a run: enough to rebuild the model and encode inputs after the data is gone.
DATASET_FILE = "dataset.json"
# What a run writes besides its checkpoints.
RUN_FILES = ("metrics.jsonl", "config.toml", "trace.json", DATASET_FILE)


def set_aside_run(run_dir: str | os.PathLike) -> str | None:
    """Move a run directory's checkpoints and records into ``previous-<time>/``; return
    it (None when there was nothing). For a deliberate fresh start in a used run
    directory (``--resume=never``): the old run's results are moved, never deleted.
    Call it on one rank."""
    run_dir = os.fspath(run_dir)
    checkpoints = os.path.join(run_dir, CHECKPOINT_DIR)
    items = [os.path.join(run_dir, n) for n in RUN_FILES
             if os.path.exists(os.path.join(run_dir, n))]
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        items.append(checkpoints)
    if not items:
        return None
    aside = os.path.join(run_dir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside, exist_ok=True)
    for item in items:
        os.replace(item, os.path.join(aside, os.path.basename(item)))
    _fsync_dir(run_dir)
    return aside


__all__ = ["CHECKPOINT_DIR", "CORRUPT_DIR", "DATASET_FILE", "RUN_FILES", "companions",
           "listed_checkpoints", "keep_last", "set_aside_corrupt", "set_aside_after",
           "set_aside_run"]
