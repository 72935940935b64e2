"""Mixed precision on the gpt task (#26): fp16 and bf16 with fp32 master weights against
fp32, through ``mpidl train gpt --precision ...`` itself.

Each precision trains the ``gpt`` preset (width 64, 2 blocks, sequence 32, batch 32) for
``--steps`` steps from the same seed on the same corpus, logging every 10 steps; the
table gives the train loss of each 10-step window beside fp32's (the largest gap over
the run, and the last window), the final test loss, the median step time and the bytes
per parameter the run reports (parameters + gradients + optimizer state, from the
wrappers' ``state_bytes``). Not part of CI (tests/unit/test_precision_train.py runs a
smaller model for the same steps). Run from the repository root::

    .venv/bin/python benchmarks/mixed_precision.py                    # 200 steps, 1 rank
    .venv/bin/python benchmarks/mixed_precision.py --ranks 2 --zero 2
    .venv/bin/python benchmarks/mixed_precision.py --json mixed_precision.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PRECISIONS = ("fp32", "fp16", "bf16")


def train(precision: str, args: argparse.Namespace, work: str) -> list[dict]:
    """The metrics records of one ``mpidl train gpt`` run at ``precision``."""
    run = os.path.join(work, precision)
    cmd = [sys.executable, "-m", "mpidl", "train", "gpt", f"--precision={precision}",
           f"--steps={args.steps}", "--log-every=10", "--progress=never",
           f"--run-dir={run}", f"--data.cache-dir={os.path.join(work, 'cache')}",
           f"--zero={args.zero}", "--checkpoint-epochs=false"]
    if args.ranks > 1:
        cmd = ["mpiexec", "--oversubscribe", "-n", str(args.ranks), *cmd]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{precision}: exit {done.returncode}\n{done.stderr[-3000:]}")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def summary(records: list[dict]) -> dict:
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    last = train[-1]
    params = sum(last["state_bytes_parameters"]) / len(last["state_bytes_parameters"])
    held = sum(sum(last[f"state_bytes_{k}"]) / len(last[f"state_bytes_{k}"])
               for k in ("parameters", "gradients", "optimizer"))
    return {"loss": [r["loss"] for r in train], "test_loss": evals[-1]["test_loss"],
            "step_ms": 1e3 * statistics.median(r["time_step"] for r in train),
            "held_bytes": held, "parameter_bytes": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mpidl-mixed-") as work:
        results = {p: summary(train(p, args, work)) for p in PRECISIONS}
    ref = results["fp32"]
    elements = ref["parameter_bytes"] / 4  # fp32 parameters: 4 bytes each (per rank)
    print(f"gpt preset, {args.steps} steps, {args.ranks} rank(s), zero {args.zero}")
    print(f"{'precision':>9}  {'max |dloss|':>11}  {'last loss':>9}  {'test loss':>9}  "
          f"{'step ms':>7}  {'bytes/param':>11}")
    for name, r in results.items():
        gap = max(abs(a - b) for a, b in zip(r["loss"], ref["loss"]))
        print(f"{name:>9}  {gap:11.4f}  {r['loss'][-1]:9.4f}  {r['test_loss']:9.4f}  "
              f"{r['step_ms']:7.1f}  {r['held_bytes'] / elements:11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
