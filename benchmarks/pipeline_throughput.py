"""Throughput of pipeline layouts against data parallelism on the same gpt model (#26).

Runs ``mpidl train gpt`` at the same rank count, global batch and model, once data
parallel and once per pipeline schedule, and reports each run's samples per second
(the summary's, after the first steps) and its ratio to data parallelism, with the
pipeline runs' measured bubble. Not part of CI. From the repository root::

    .venv/bin/python benchmarks/pipeline_throughput.py --ranks 2 --steps 40

The model fits one rank here: the pipeline is measured for what it costs (the bubble,
the activations sent), not for the memory it saves, which is its reason to exist.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = {
    "data parallel": [],
    "pipeline gpipe": ["--pipeline-parallel={p}", "--pipeline-schedule=gpipe"],
    "pipeline 1f1b": ["--pipeline-parallel={p}", "--pipeline-schedule=1f1b"],
    "pipeline interleaved v=2": ["--pipeline-parallel={p}",
                                 "--pipeline-schedule=interleaved", "--virtual-stages=2"],
}


def run(ranks: int, args: argparse.Namespace, extra: list[str], out: str) -> dict:
    from mpidl.testing.launch import launch_env, mpiexec_command

    cmd = mpiexec_command(ranks, [
        sys.executable, "-m", "mpidl", "train", "gpt", f"--steps={args.steps}",
        f"--global-batch={args.batch}", f"--microbatches={args.microbatches}",
        f"--model.layers={args.layers}", f"--model.dim={args.dim}", "--progress=never",
        "--resume=never", "--eval-every=1000000", f"--run-dir={out}",
        *[e.format(p=ranks) for e in extra]])
    done = subprocess.run(cmd, env=launch_env(), cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rate = float(re.search(r"samples/s:\s+([\d.]+)", done.stdout).group(1))
    bubble = re.search(r"bubble ([\d.]+-[\d.]+)", done.stdout)
    return {"rate": rate, "bubble": bubble.group(1) if bubble else "-"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--out", default="runs/pipeline-throughput")
    args = p.parse_args()
    base = None
    print("layout                      samples/s  vs data parallel  bubble (by rank)")
    for name, extra in LAYOUTS.items():
        result = run(args.ranks, args, extra, os.path.join(args.out, name.replace(" ", "-")))
        base = base or result["rate"]
        print(f"{name:26s}  {result['rate']:9.1f}  {result['rate'] / base:16.2f}  "
              f"{result['bubble']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
