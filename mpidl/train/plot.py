"""``mpidl plot RUN_DIR``: PNG plots of a run's metrics (needs the ``plot`` extra).

::

    mpidl plot runs/reviews-bow-20250101-120000          # writes into the run directory
    mpidl plot RUN_DIR --out figures/

Reads ``RUN_DIR/metrics.jsonl`` (:mod:`mpidl.train.metrics`) and writes

* ``loss.png``: training loss per step, test loss at each evaluation;
* ``accuracy.png``: training accuracy per step, test accuracy at each evaluation;
* ``throughput.png``: samples/s per step, and each step's time split into compute,
  communication wait and input wait (stacked).

A resumed run may have logged some steps twice (before and after the restart): the last
record of each step is the one plotted.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from hpc.files import OutputError, check_output
from mpidl.train.metrics import read_metrics


def _matplotlib():
    try:
        # here: matplotlib is an extra ([plot]), needed by `mpidl plot` alone
        import matplotlib
    except ImportError:
        raise ImportError("mpidl plot needs matplotlib: install it with "
                          "`pip install 'mpidl[plot]'`") from None
    matplotlib.use("Agg")       # files only; no display on a compute node
    # after use("Agg"): pyplot picks its backend when first imported
    import matplotlib.pyplot as plt

    return plt


def _series(records: Sequence[dict[str, Any]], kind: str, key: str) -> tuple[list, list]:
    """(steps, values) of ``key`` in records of ``kind``, last record per step wins."""
    by_step: dict[int, float] = {}
    for r in records:
        if r.get("kind") == kind and isinstance(r.get("step"), int) and isinstance(
                r.get(key), (int, float)) and not isinstance(r.get(key), bool):
            by_step[r["step"]] = r[key]
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _line_plot(plt, path: str, title: str, ylabel: str,
               series: list[tuple[str, tuple, str]]) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    drawn = False
    for label, (x, y), style in series:
        if x:
            ax.plot(x, y, style, label=label)
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def plot_run(run_dir: str, out_dir: str | None = None, force: bool = False) -> list[str]:
    """Write the plots of ``run_dir``'s metrics into ``out_dir`` (default: run_dir);
    return paths. An existing plot is written over only with ``force``
    (:func:`hpc.files.check_output`: OutputError)."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise FileNotFoundError(f"{metrics} does not exist; is {run_dir!r} a run directory "
                                "of `mpidl train`?")
    plt = _matplotlib()  # after the input's check: a wrong path is told before a missing extra
    records = read_metrics(metrics)
    out_dir = out_dir or run_dir
    for png in ("loss.png", "accuracy.png", "throughput.png"):
        check_output(os.path.join(out_dir, png), force=force, reads=[metrics])
    os.makedirs(out_dir, exist_ok=True)
    name = os.path.basename(os.path.normpath(run_dir))
    written = []

    path = os.path.join(out_dir, "loss.png")
    _line_plot(plt, path, f"loss — {name}", "cross-entropy loss", [
        ("train", _series(records, "train", "loss"), "-"),
        ("test", _series(records, "eval", "test_loss"), "o-"),
    ])
    written.append(path)

    path = os.path.join(out_dir, "accuracy.png")
    _line_plot(plt, path, f"accuracy — {name}", "accuracy", [
        ("train", _series(records, "train", "accuracy"), "-"),
        ("test", _series(records, "eval", "test_accuracy"), "o-"),
    ])
    written.append(path)

    path = os.path.join(out_dir, "throughput.png")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    x, y = _series(records, "train", "samples_per_s")
    top.plot(x, y, "-")
    top.set_ylabel("samples/s")
    top.set_title(f"throughput — {name}")
    top.grid(alpha=0.3)
    parts = [(label, _series(records, "train", key)) for label, key in
             (("compute", "time_compute"), ("comm wait", "time_comm"),
              ("input wait", "time_input"))]
    steps = parts[0][1][0]
    if steps and all(p[1][0] == steps for p in parts):
        bottom.stackplot(steps, *[[1000 * v for v in p[1][1]] for p in parts],
                         labels=[p[0] for p in parts], alpha=0.8)
        bottom.legend(loc="upper right")
    bottom.set_xlabel("step")
    bottom.set_ylabel("time per step (ms)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mpidl plot``."""
    parser = argparse.ArgumentParser(prog="mpidl plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (with metrics.jsonl)")
    parser.add_argument("--out", help="where to write the PNG files (default: RUN_DIR)")
    parser.add_argument("--force", action="store_true", help="write over existing plots")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        paths = plot_run(args.run_dir, args.out, args.force)
    except (ImportError, OSError, OutputError) as e:  # refused before any work
        print(f"mpidl plot: error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
