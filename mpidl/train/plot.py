"""``mpidl plot RUN_DIR``: PNG plots of a run's metrics (needs the ``plot`` extra).

::

    mpidl plot runs/reviews-bow-20250101-120000          # writes into the run directory
    mpidl plot RUN_DIR --out figures/
    mpidl plot RUN_DIR --out figures/run.png             # one figure of the three panels

Reads ``RUN_DIR/metrics.jsonl`` (:mod:`mpidl.train.metrics`) and writes

* ``loss.png``: training loss per step, test loss at each evaluation;
* ``accuracy.png``: training accuracy per step, test accuracy at each evaluation;
* ``throughput.png``: samples/s per step, and each step's time split into compute,
  communication wait and input wait (stacked).

into RUN_DIR or the directory ``--out`` names; an ``--out`` ending in an image suffix
matplotlib writes (``.png``, ``.svg``, ``.pdf``, ``.jpg``, ...) is one file holding the
three panels instead, unless a directory of that name is already there.

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


def _line_panel(ax, title: str, ylabel: str, series: list[tuple[str, tuple, str]]) -> None:
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


def plot_run(run_dir: str, out_dir: str | None = None, force: bool = False) -> list[str]:
    """Write the plots of ``run_dir``'s metrics; return their paths. ``out_dir`` (default:
    run_dir) is a directory for the three PNGs, or a file name with an image suffix
    (``run.png``, ``run.svg``, ``run.pdf``) for one figure of the three panels. An
    existing plot is written over only with ``force`` (:func:`hpc.files.check_output`:
    OutputError)."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise FileNotFoundError(f"{metrics} does not exist; is {run_dir!r} a run directory "
                                "of `mpidl train`?")
    records = read_metrics(metrics)
    name = os.path.basename(os.path.normpath(run_dir))
    out = out_dir or run_dir
    files = ("loss.png", "accuracy.png", "throughput.png")
    for path in [out] if _image_file(out) else [os.path.join(out, f) for f in files]:
        check_output(path, force=force, reads=[metrics])
    plt = _matplotlib()  # after the input's checks: bad input is told before a missing extra
    if _image_file(out):
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig = run_figure(plt, records, name)
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return [out]
    os.makedirs(out, exist_ok=True)
    figures = [
        ("loss.png", (7, 4.2), 1, _loss_panel),
        ("accuracy.png", (7, 4.2), 1, _accuracy_panel),
        ("throughput.png", (7, 6), 2, _throughput_panel),
    ]
    written = []
    for file, size, rows, draw in figures:
        fig, axes = plt.subplots(rows, 1, figsize=size, sharex=True)
        draw(*(axes if rows > 1 else [axes]), records, name)
        fig.tight_layout()
        path = os.path.join(out, file)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _loss_panel(ax, records: Sequence[dict[str, Any]], name: str) -> None:
    _line_panel(ax, f"loss — {name}", "cross-entropy loss", [
        ("train", _series(records, "train", "loss"), "-"),
        ("test", _series(records, "eval", "test_loss"), "o-"),
    ])


def _accuracy_panel(ax, records: Sequence[dict[str, Any]], name: str) -> None:
    _line_panel(ax, f"accuracy — {name}", "accuracy", [
        ("train", _series(records, "train", "accuracy"), "-"),
        ("test", _series(records, "eval", "test_accuracy"), "o-"),
    ])


def _throughput_panel(top, bottom, records: Sequence[dict[str, Any]], name: str) -> None:
    """Samples/s in ``top``; each step's time split into compute, communication wait and
    input wait (stacked) in ``bottom``."""
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


def run_figure(plt, records: Sequence[dict[str, Any]], name: str) -> Any:
    """One figure of the three panels: loss and accuracy side by side above, throughput
    below them (samples/s over the split of each step's time)."""
    fig = plt.figure(figsize=(12, 9))
    grid = fig.add_gridspec(3, 2, height_ratios=(2, 1, 1))
    _loss_panel(fig.add_subplot(grid[0, 0]), records, name)
    _accuracy_panel(fig.add_subplot(grid[0, 1]), records, name)
    top = fig.add_subplot(grid[1, :])
    _throughput_panel(top, fig.add_subplot(grid[2, :], sharex=top), records, name)
    fig.tight_layout()
    return fig


# The file types matplotlib's Agg and vector backends write (FigureCanvasBase.
# get_supported_filetypes() of matplotlib 3.5-3.10), named here so that --out is judged,
# and an existing file refused, before matplotlib is imported (or found missing).
IMAGE_SUFFIXES = frozenset({"eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba",
                            "svg", "svgz", "tif", "tiff", "webp", "avif", "gif"})


def _image_file(out: str) -> bool:
    """Whether ``--out`` names one image file: a suffix matplotlib writes (``.png``,
    ``.svg``, ``.pdf``, ...), and not a directory already there (a directory stays one,
    whatever its name)."""
    suffix = os.path.splitext(out)[1].lower().lstrip(".")
    return suffix in IMAGE_SUFFIXES and not os.path.isdir(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``mpidl plot``."""
    parser = argparse.ArgumentParser(prog="mpidl plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run directory (with metrics.jsonl)")
    parser.add_argument("--out", help="a directory for the three PNG files (default: "
                        "RUN_DIR), or one image file of the three panels: a name ending in "
                        ".png, .svg, .pdf or another suffix matplotlib writes")
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
