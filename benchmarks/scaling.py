"""Scaling study of `mpidl train`: throughput and parallel efficiency from 1 to N ranks.

Each rank count is one `mpidl train` run with the same arguments (so the same global
batch: strong scaling), into ``OUT/train-N``; the report reads each run's metrics (the
median samples/s of its train records after the first quarter, i.e. after warm-up),
prints speedup and efficiency against 1 rank, and plots both::

    .venv/bin/python benchmarks/scaling.py run --ranks 1,2,3 --out runs/scaling -- \\
        --epochs=2 --progress=never
    .venv/bin/python benchmarks/scaling.py report runs/scaling/train-*  --plot scaling.png

On a cluster the runs come from the benchmark template unchanged:
``MPIDL_BENCH_TRAIN="--epochs=2" sbatch slurm/bench.sbatch`` writes
``runs/mpidl-bench-<job>/train-N`` for N = 2, 4, ... and the full size; then
``report`` over those directories (a 1-rank run, if missing, is the smallest count's
baseline instead, and efficiency is relative to it).

On this 2-core machine a third rank is oversubscribed: such counts are marked.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(ranks: Sequence[int], out: str, train_args: Sequence[str], timeout: float) -> None:
    from mpidl.testing.launch import launch_env, mpiexec_command

    for n in ranks:
        run_dir = os.path.join(out, f"train-{n}")
        cmd = mpiexec_command(n, [sys.executable, "-m", "mpidl", "train", *train_args,
                                  f"--run-dir={run_dir}", "--resume=never"])
        print(f"# {' '.join(cmd)}", flush=True)
        done = subprocess.run(cmd, env=launch_env(), cwd=ROOT, timeout=timeout,
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the {n}-rank run failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def measure(run_dir: str) -> dict:
    """A run's ranks and median samples/s after warm-up, from its files."""
    from mpidl.train.metrics import read_metrics

    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
               if r.get("kind") == "train" and r.get("samples_per_s")]
    if not records:
        raise SystemExit(f"{run_dir}: no train records with samples/s")
    steady = records[len(records) // 4:] or records
    m = re.search(r"train-(\d+)$", run_dir.rstrip("/"))
    ranks = int(m.group(1)) if m else _ranks_from_checkpoint(run_dir)
    return {"run": run_dir, "ranks": ranks,
            "samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
            "compute_ms": 1e3 * statistics.median(r["time_compute"] for r in steady),
            "comm_ms": 1e3 * statistics.median(r["time_comm"] for r in steady)}


def _ranks_from_checkpoint(run_dir: str) -> int:
    from mpidl.train.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    return int(load_checkpoint(path).extra.get("ranks", 1)) if path else 1


def report(run_dirs: Sequence[str], plot: str | None, cores: int) -> list[dict]:
    rows = sorted((measure(d) for d in run_dirs), key=lambda r: r["ranks"])
    base = rows[0]
    for r in rows:
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
        r["efficiency"] = r["speedup"] * base["ranks"] / r["ranks"]
        r["oversubscribed"] = r["ranks"] > cores
    print(f"| ranks | samples/s | speedup vs {base['ranks']} | efficiency | compute ms | "
          "comm ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mark = " (oversubscribed)" if r["oversubscribed"] else ""
        print(f"| {r['ranks']}{mark} | {r['samples_per_s']:.0f} | {r['speedup']:.2f} | "
              f"{r['efficiency']:.2f} | {r['compute_ms']:.2f} | {r['comm_ms']:.2f} |")
    print(json.dumps(rows))
    if plot:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 4))
        ax_t, ax_e = fig.subplots(1, 2)
        n = [r["ranks"] for r in rows]
        ax_t.plot(n, [r["samples_per_s"] for r in rows], marker="o", label="measured")
        ax_t.plot(n, [base["samples_per_s"] * k / base["ranks"] for k in n], "--",
                  color="grey", label="linear")
        ax_t.set(xlabel="ranks", ylabel="samples/s", title="throughput (strong scaling)")
        ax_t.legend()
        ax_e.plot(n, [r["efficiency"] for r in rows], marker="o")
        ax_e.set(xlabel="ranks", ylabel="parallel efficiency", ylim=(0, 1.1),
                 title="efficiency")
        for ax in (ax_t, ax_e):
            ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"# plot: {plot}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run mpidl train at each rank count, then report")
    r.add_argument("--ranks", default="1,2")
    r.add_argument("--out", default="runs/scaling")
    r.add_argument("--timeout", type=float, default=1800)
    r.add_argument("--plot", default=None)
    rep = sub.add_parser("report", help="report on existing train-N run directories")
    rep.add_argument("runs", nargs="+")
    rep.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.what == "run":
        ranks = [int(x) for x in args.ranks.split(",")]
        run(ranks, args.out, extra, args.timeout)
        report([os.path.join(args.out, f"train-{n}") for n in ranks], args.plot, cores)
    else:
        report(args.runs, args.plot, cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())
