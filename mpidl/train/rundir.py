"""The run directory: what a run claims of it, once its resume has succeeded.

A run directory holds ``config.toml``, ``metrics.jsonl``, ``trace.json``,
``dataset.json`` and ``checkpoints/``. Building a run and choosing where it resumes
read it only; :func:`claim_run_dir` is the first change, made by rank 0 once the resume
is accepted, so that a refused or failed resume leaves the directory exactly as it was.
"""
from __future__ import annotations

import os
from typing import Any

from hpc.files import write_text
from mpidl.data.description import write_description
from mpidl.train.metrics import trim_metrics
from mpidl.train.retention import (CHECKPOINT_DIR, DATASET_FILE, listed_checkpoints,
                                   set_aside_after, set_aside_corrupt, set_aside_run)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.toml"
TRACE_FILE = "trace.json"


def checkpoint_dir(run_dir: str) -> str:
    """Where a run's checkpoints are: ``RUN_DIR/checkpoints``."""
    return os.path.join(run_dir, CHECKPOINT_DIR)


def last_checkpoint(run_dir: str) -> str:
    """The newest checkpoint listed in ``run_dir``, or ``"none written yet"``. Not
    collective (it lists the directory)."""
    listed = listed_checkpoints(checkpoint_dir(run_dir))
    return listed[-1] if listed else "none written yet"


def claim_run_dir(run_dir: str, config_text: str, step: int, train_set: Any,
                  corrupt: list[tuple[str, str]] = (), previous: bool = False) -> list[str]:
    """Make ``run_dir`` the run's that resumes at ``step`` (0: a fresh start); returns the
    notes to show. Rank 0 only; raises OSError (a full disk, permissions).

    In an order where a failure leaves what it had not done yet as it was: with
    ``previous`` (a fresh start by ``--resume=never``) the old checkpoints, metrics and
    config first move to ``RUN_DIR/previous-<time>/``; then ``metrics.jsonl`` is trimmed
    to ``step`` (records of a job that died before its first checkpoint go),
    ``config.toml`` written, checkpoints that failed to load (``corrupt``: ``(path,
    reason)``) moved into ``corrupt/``, newer checkpoints of another branch moved
    aside, and what predicting needs of ``train_set`` once it is gone written
    (:mod:`mpidl.data.description`).
    """
    notes = []
    os.makedirs(run_dir, exist_ok=True)
    if previous:
        aside = set_aside_run(run_dir)
        if aside:
            notes.append(f"--resume=never: the previous checkpoints and metrics of this "
                         f"run directory moved to {aside}")
    trim_metrics(os.path.join(run_dir, METRICS_FILE), step)
    write_text(os.path.join(run_dir, CONFIG_FILE), config_text)
    for (path, reason), moved in zip(corrupt, set_aside_corrupt(
            [p for p, _ in corrupt])):
        notes.append(f"warning: {reason}; moved to {moved}")
    aside = set_aside_after(checkpoint_dir(run_dir), step)
    if aside:
        notes.append(f"checkpoints after step {step} (another branch of this run) "
                     f"moved to {aside}")
    write_description(os.path.join(run_dir, DATASET_FILE), train_set.manifest,
                      train_set.path)
    return notes


__all__ = ["claim_run_dir", "checkpoint_dir", "last_checkpoint", "METRICS_FILE",
           "CONFIG_FILE", "TRACE_FILE"]
