"""PowerSGD against the uncompressed exchange on the virtual cluster: step time and test
accuracy of the reference mlp after the same epochs, at one node and at two over a
shaped link (docs/planning.md "Compression and slow networks").

As root, with nothing else using the virtual cluster's subnet::

    .venv/bin/python benchmarks/compression_check.py --rate 1gbit --epochs 3 \\
        --compression none,powersgd:1,powersgd:4

It brings up its own two-node cluster (one rank per node, one BLAS thread per rank),
trains the mlp (784 -> 1024 -> 1024 -> 10, a 7.5 MB gradient) on a learnable
784-feature, 10-class dataset at one node uncompressed and at two nodes with each
compression, and prints one table row per run: the median step (compute + exchange
wait), the speedup over one node, the final test accuracy and, for 2 nodes, what
`mpidl plan --network` (a profile benched across the two nodes first) predicted for
that step. Brings the cluster down after, also on failure.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# plan_check's cluster (its name and subnet: do not run the two at once) and medians
from plan_check import EXPORT, PROFILE, _cluster, _medians, cluster  # noqa: E402

MLP = ["--task=custom", "--model=mlp", "--global-batch=256", "--base-batch=256"]


def learnable_data(root: str, rows: int = 14_800) -> str:
    """784 features, 10 classes by a fixed linear rule with noise (what a linear model
    gets right about 90% of the time): an accuracy to lose, unlike random labels."""
    import numpy

    out = os.path.join(root, "data")
    rng = numpy.random.default_rng(0)
    x = rng.standard_normal((rows, 784)).astype(numpy.float32)
    w = rng.standard_normal((784, 10)).astype(numpy.float32)
    y = numpy.argmax(x @ w + rng.standard_normal((rows, 10)) * 4.0, axis=1)
    path = os.path.join(root, "data.npz")
    numpy.savez(path, x=x, y=y)
    subprocess.run([sys.executable, "-m", "mpidl", "shard", "--from-npz", path, out,
                    "--test-fraction", str(2000 / rows)], check=True, capture_output=True)
    return out


def planned(data: str, how: str, start: int, env: dict) -> dict:
    """``mpidl plan``'s 2-rank row (one rank per node) on the benched profile, with
    ``how``'s compression (the uncompressed row for "none")."""
    out = os.path.join(tempfile.mkdtemp(prefix="plan-"), "plan.json")  # a new file
    done = subprocess.run(
        [sys.executable, "-m", "mpidl", "plan", *MLP, f"--data={data}", "--ranks", "1,2",
         "--network", PROFILE, "--ranks-per-node", "1",
         "--cores", str(len(os.sched_getaffinity(0))), f"--start-powersgd-iter={start}",
         *(["--compression", how] if how != "none" else []), "--json", out],
        capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"plan failed:\n{done.stderr[-2000:]}")
    with open(out) as f:
        doc = json.load(f)
    rows = doc["compression"]["rows"] if how != "none" else doc["rows"]
    return next(r for r in rows if r["ranks"] == 2)


def final_accuracy(run: str) -> float:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        evals = [r for r in map(json.loads, f) if r.get("kind") == "eval"]
    return evals[-1]["test_accuracy"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="1gbit", help="the links' rate (tc), e.g. 1gbit, 10gbit")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--compression", default="none,powersgd:1,powersgd:4",
                   help="comma-separated --compression values to train at 2 nodes")
    p.add_argument("--start-powersgd-iter", type=int, default=25,
                   help="uncompressed steps first (50 steps make an epoch here)")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="compression-check-")
    data = learnable_data(root)
    runs = [(1, "none")] + [(2, c) for c in args.compression.split(",")]
    rows = []
    with cluster(2, args.rate, root) as env:
        # the network at 2 nodes, down to PowerSGD's small messages, for the plan
        old = os.path.join(env["MPIDL_PROFILE_DIR"], "network", f"{PROFILE}.toml")
        if os.path.exists(old):
            os.remove(old)
        _cluster("mpiexec", "--nodes", "2", "-n", "2", *EXPORT, "mpidl", "bench", "--op",
                 "allreduce,iallreduce", "--min-bytes", "1KiB", "--max-bytes", "16MiB",
                 "--factor", "4", "--windows", "3", "--save-profile", PROFILE, env=env)
        for nodes, how in runs:
            run = os.path.join(root, f"{nodes}-{how.replace(':', '')}")
            _cluster("mpiexec", "--nodes", str(nodes), "-n", str(nodes), *EXPORT,
                     "mpidl", "train", *MLP, f"--data={data}", f"--epochs={args.epochs}",
                     "--log-every=1", "--progress=never", "--no-checkpoint-epochs",
                     f"--run-dir={run}", f"--compression={how}",
                     f"--start-powersgd-iter={args.start_powersgd_iter}", env=env)
            plan = planned(data, how, args.start_powersgd_iter, env) if nodes == 2 else None
            rows.append((nodes, how, _medians(run), final_accuracy(run), plan))
            print(f"done: {nodes} node(s), {how}", flush=True)
    base = rows[0][2]["step"]
    print(f"\n| nodes | compression | step ms (compute + exchange) | speedup | test accuracy "
          f"after {args.epochs} epochs | planned ms | plan's error |\n"
          + "|---" * 7 + "|")
    for nodes, how, m, acc, plan in rows:
        said = (f"{plan['step_s'] * 1e3:.1f} | {plan['step_s'] / m['step'] - 1:+.0%}"
                if plan else " | ")
        print(f"| {nodes} | {how} | {m['step'] * 1e3:.1f} ({m['compute'] * 1e3:.1f} + "
              f"{m['comm'] * 1e3:.1f}) | {base / m['step']:.2f}x | {acc:.4f} | {said} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
