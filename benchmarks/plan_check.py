"""Check `mpidl plan` against measured runs: predicted vs measured step time per rank count.

For each reference model, the plan's prediction for one node (``--ranks-per-node`` =
the largest count, ``--node-network shm``) is set beside the median step time of real
`mpidl train` runs at the same rank counts (the ``time_step`` of their train records
after warm-up)::

    .venv/bin/python benchmarks/plan_check.py --ranks 1,2,3 --steps 300

Counts above this machine's cores are oversubscribed and marked (the planner assumes a
core per rank). Prints one JSON line per case, then a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _mlp_data(root: str) -> str:
    """A 784-feature, 10-class dataset for the reference mlp (12,800 rows)."""
    import numpy

    rng = numpy.random.default_rng(0)
    y = rng.integers(0, 10, 12800)
    x = rng.standard_normal((12800, 784)).astype(numpy.float32) + y[:, None] * 0.01
    path = os.path.join(root, "mlp.npz")
    numpy.savez(path, x=x, y=y)
    out = os.path.join(root, "mlp-data")
    subprocess.run([sys.executable, "-m", "mpidl", "shard", "--from-npz", path, out,
                    "--test-fraction", "0.02"], check=True, capture_output=True)
    return out


CASES = {
    "bow": ["reviews"],
    "transformer": ["reviews-transformer"],
    "mlp": [None, "--model=mlp", "--global-batch=256", "--base-batch=256"],
}


def _args(case: str, data: str | None, cache: str) -> list[str]:
    preset, *rest = CASES[case]
    args = ([preset] if preset else []) + rest + [f"--data.cache-dir={cache}"]
    return args + ([f"--data={data}"] if case == "mlp" else [])


def predicted(case: str, ranks: Sequence[int], data: str | None, cache: str) -> dict[int, dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "mpidl", "plan", *_args(case, data, cache),
               "--ranks", ",".join(map(str, ranks)), "--ranks-per-node", str(max(ranks)),
               "--node-network", "shm", "--json", out.name]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
        doc = json.load(open(out.name))
    return {r["ranks"]: r for r in doc["rows"]}


def measured(case: str, n: int, steps: int, data: str | None, cache: str, root: str) -> dict:
    from mpidl.testing.launch import launch_env, mpiexec_command
    from mpidl.train.metrics import read_metrics

    run = os.path.join(root, f"{case}-{n}")
    cmd = mpiexec_command(n, [sys.executable, "-m", "mpidl", "train", *_args(case, data, cache),
                              f"--steps={steps}", "--log-every=10", "--progress=never",
                              "--no-checkpoint-epochs", f"--run-dir={run}"])
    done = subprocess.run(cmd, env=launch_env(), cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{case} at {n} ranks failed:\n{done.stderr[-2000:]}")
    records = [r for r in read_metrics(os.path.join(run, "metrics.jsonl"))
               if r.get("kind") == "train"]
    steady = records[len(records) // 4:]
    return {k: statistics.median(r[f"time_{k}"] for r in steady)
            for k in ("step", "compute", "comm", "input")}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="bow,transformer,mlp")
    p.add_argument("--ranks", default="1,2,3")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    cores = len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as root:
        cache = os.path.join(root, "cache")
        data = _mlp_data(root) if "mlp" in args.cases else None
        for case in args.cases.split(","):
            plan = predicted(case, ranks, data, cache)
            for n in ranks:
                m = measured(case, n, args.steps, data, cache, root)
                row = {"model": case, "ranks": n, "oversubscribed": n > cores,
                       "predicted_ms": plan[n]["step_s"] * 1e3, "measured_ms": m["step"] * 1e3,
                       "predicted_compute_ms": plan[n]["compute_s"] * 1e3,
                       "measured_compute_ms": m["compute"] * 1e3,
                       "predicted_comm_ms": plan[n]["exposed_comm_s"] * 1e3,
                       "measured_comm_ms": m["comm"] * 1e3}
                row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| model | ranks | predicted step ms (compute + comm) | measured step ms "
          "(compute + comm) | error |\n|---|---|---|---|---|")
    for r in rows:
        mark = " (oversubscribed)" if r["oversubscribed"] else ""
        print(f"| {r['model']} | {r['ranks']}{mark} | {r['predicted_ms']:.2f} "
              f"({r['predicted_compute_ms']:.2f} + {r['predicted_comm_ms']:.2f}) | "
              f"{r['measured_ms']:.2f} ({r['measured_compute_ms']:.2f} + "
              f"{r['measured_comm_ms']:.2f}) | {r['error']:+.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
