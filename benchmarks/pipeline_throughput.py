"""Throughput of pipeline layouts against data parallelism on the same gpt model (#26).

Runs ``mpidl train gpt`` at the same rank count, global batch ``B`` and model, data
parallel and once per pipeline schedule, in ``--rounds`` rounds that alternate the
layouts (so a shared machine's load hits all alike), and reports each layout's samples
per second, ``B`` over the median step time of the steps after ``--warmup`` (from the
run's metrics, one record a step), its ratio to data parallelism and the pipeline's
measured bubble (the median over the steps, by rank). Not part of CI. From the
repository root::

    .venv/bin/python benchmarks/pipeline_throughput.py --ranks 2 --steps 20 --rounds 3

Two data-parallel baselines, because the microbatch's size decides NumPy's speed at
these widths: ``data parallel m`` accumulates over the pipeline's ``m`` microbatches
(``B / (p m)`` rows each, ``1/p`` of the pipeline's), ``data parallel m/p``
over ``m / p`` (``B / m`` rows each: the pipeline's microbatch). The run's own summary
(samples/s over the whole run) is printed beside: it includes the start, the final
evaluation and the checkpoint, which take the pipeline and data parallelism different
times, so it is not the step's throughput.

The model fits one rank here: the pipeline is measured for what it costs (the bubble,
the activations sent), not for the memory it saves, which is its reason to exist.
Measured on a quiet 2-core machine (benchmarks/README.md, 2026-12-02): GPipe, 1F1B and
interleaved at 0.92, 0.96 and 0.98x ``data parallel m``, 0.82-0.88x ``m/p``.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PIPELINE = ["--pipeline-parallel={p}"]
LAYOUTS = {
    "data parallel m": ["--microbatches={m}"],
    "data parallel m/p": ["--microbatches={m_p}"],
    "pipeline gpipe": [*PIPELINE, "--microbatches={m}", "--pipeline-schedule=gpipe"],
    "pipeline 1f1b": [*PIPELINE, "--microbatches={m}", "--pipeline-schedule=1f1b"],
    "pipeline interleaved v=2": [*PIPELINE, "--microbatches={m}",
                                 "--pipeline-schedule=interleaved", "--virtual-stages=2"],
}


def step_rate(records: list[dict], batch: int, warmup: int) -> tuple[float, str]:
    """``batch`` over the median ``time_step`` of the train records after step
    ``warmup``, and the median ``pipeline_bubble`` by rank ("-" without a pipeline)."""
    steps = [r for r in records if r.get("kind") == "train" and r["step"] > warmup]
    if not steps:
        raise ValueError(f"no train records after step {warmup}: run more --steps")
    rate = batch / statistics.median(r["time_step"] for r in steps)
    if "pipeline_bubble" not in steps[0]:
        return rate, "-"
    ranks = zip(*(r["pipeline_bubble"] for r in steps))
    return rate, " ".join(f"{statistics.median(b):.2f}" for b in ranks)


def run(ranks: int, args: argparse.Namespace, extra: list[str], out: str) -> dict:
    from mpidl.testing.launch import launch_env, mpiexec_command
    from mpidl.train.metrics import read_metrics

    fill = dict(p=ranks, m=args.microbatches, m_p=max(1, args.microbatches // ranks))
    cmd = mpiexec_command(ranks, [
        sys.executable, "-m", "mpidl", "train", "gpt", f"--steps={args.steps}",
        f"--global-batch={args.batch}", f"--model.layers={args.layers}",
        f"--model.dim={args.dim}", "--progress=never", "--resume=never", "--log-every=1",
        "--eval-every=1000000", f"--run-dir={out}", *[e.format(**fill) for e in extra]])
    done = subprocess.run(cmd, env=launch_env(), cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rate, bubble = step_rate(read_metrics(os.path.join(out, "metrics.jsonl")), args.batch,
                             args.warmup)
    whole = float(re.search(r"samples/s:\s+([\d.]+)", done.stdout).group(1))
    return {"rate": rate, "whole": whole, "bubble": bubble}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--rounds", type=int, default=2, help="runs per layout, alternated")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--out", default="runs/pipeline-throughput")
    args = p.parse_args()
    print(f"mpidl train gpt at {args.ranks} ranks: batch {args.batch}, "
          f"{args.microbatches} microbatches, {args.layers} layers of width {args.dim}; "
          f"samples/s = batch / median step after step {args.warmup}; {args.rounds} rounds "
          f"alternating the layouts (os.getloadavg at start: {os.getloadavg()[0]:.1f})")
    results: dict[str, list[dict]] = {name: [] for name in args.layouts}
    for r in range(args.rounds):
        for name in args.layouts:
            out = os.path.join(args.out, f"{name.replace(' ', '-').replace('/', '-')}-{r}")
            results[name].append(run(args.ranks, args, LAYOUTS[name], out))
    base = statistics.median(x["rate"] for x in results[args.layouts[0]])
    print(f"{'layout':<26} {'samples/s':>9} {'vs ' + args.layouts[0]:>20} "
          f"{'runs':>13} {'whole run':>9}  bubble by rank (run 1)")
    for name, runs in results.items():
        rate = statistics.median(x["rate"] for x in runs)
        each = "/".join(f"{x['rate']:.0f}" for x in runs)
        whole = statistics.median(x["whole"] for x in runs)
        print(f"{name:<26} {rate:9.1f} {rate / base:20.2f} {each:>13} {whole:9.1f}  "
              f"{runs[0]['bubble']}", flush=True)
    print(f"(load average at the end: {os.getloadavg()[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
