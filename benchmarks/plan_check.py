"""Check `mpidl plan` against measured runs: predicted vs measured step time per rank count.

On one node (the default): the plan's prediction for one node (``--ranks-per-node`` =
the largest count, ``--node-network shm``; under ``--probe`` the plan runs under
``mpiexec -n 2`` and probes the fixed cost of a distributed step first) beside the
median step of real `mpidl train` runs at the same rank counts::

    .venv/bin/python benchmarks/plan_check.py --ranks 1,2,3 --steps 300
    .venv/bin/python benchmarks/plan_check.py --cases bow --ranks 1,2 --probe

Across nodes (``--rate RATE``, root): brings the virtual cluster (tests/cluster) up with
every link shaped to RATE and one rank per node, measures the network with
``mpidl bench --save-profile`` at 2 nodes, runs `mpidl train` on 1, 2 and 3 nodes, plans with
``--network`` that profile (one process here, compute measured here, ``--cores`` this
machine's: the virtual nodes share its cores), prints the table and brings the cluster
down, also on failure::

    .venv/bin/python benchmarks/plan_check.py --rate 1gbit --nodes 1,2,3 --cases mlp,transformer

Counts above this machine's cores are oversubscribed and marked. Prints one JSON line
per case, then a markdown table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CLUSTER = os.path.join(ROOT, "tests", "cluster", "cluster.sh")
# A cluster of its own (name, subnet, state folder), beside any a test has up.
CLUSTER_ENV = {"MPIDL_CLUSTER_NAME": "plancheck", "MPIDL_CLUSTER_SUBNET": "10.216.0"}
PROFILE = "plancheck"
# One BLAS thread per rank, as the planner times compute. The virtual cluster binds no
# rank to a core (its nodes share this machine's), so OpenBLAS would start a thread per
# core in every rank: measured here under load, a 256 x 1024 x 1024 matmul took 120 ms
# with 2 threads and 26 ms with one.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
EXPORT = [a for name in ONE_THREAD for a in ("-x", name)]  # to every node's ranks


def _mlp_data(root: str) -> str:
    """A 784-feature, 10-class dataset for the reference mlp (12,800 rows), made once."""
    import numpy

    out = os.path.join(root, "mlp-data")
    if os.path.isdir(out):
        return out
    rng = numpy.random.default_rng(0)
    y = rng.integers(0, 10, 12800)
    x = rng.standard_normal((12800, 784)).astype(numpy.float32) + y[:, None] * 0.01
    path = os.path.join(root, "mlp.npz")
    numpy.savez(path, x=x, y=y)
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


def predicted(case: str, ranks: Sequence[int], data: str | None, cache: str,
              extra: Sequence[str] = (), probe: int = 0, env: dict | None = None
              ) -> dict[int, dict]:
    """The plan's rows by rank count (under ``mpiexec -n probe`` when ``probe``)."""
    from mpidl.testing.launch import launch_env, mpiexec_command

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "mpidl", "plan", *_args(case, data, cache),
               "--ranks", ",".join(map(str, ranks)), *extra, "--json", out.name]
        if probe:
            cmd = mpiexec_command(probe, cmd)
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                              env=launch_env(env) if probe else env)
        if done.returncode != 0:
            raise RuntimeError(f"plan of {case} failed:\n{done.stderr[-2000:]}")
        doc = json.load(open(out.name))
    return {r["ranks"]: dict(r, overlap_share=doc["overlap_share"], fixed_from=doc["fixed_from"])
            for r in doc["rows"]}


def _medians(run: str) -> dict:
    from mpidl.train.metrics import read_metrics

    records = [r for r in read_metrics(os.path.join(run, "metrics.jsonl"))
               if r.get("kind") == "train"]
    steady = records[len(records) // 4:]
    return {k: statistics.median(r[f"time_{k}"] for r in steady)
            for k in ("step", "compute", "comm", "input")}


def _train_args(case: str, steps: int, data: str | None, cache: str, run: str) -> list[str]:
    shutil.rmtree(run, ignore_errors=True)  # a run directory left there would resume
    return ["mpidl", "train", *_args(case, data, cache), f"--steps={steps}", "--log-every=1",
            "--progress=never", "--no-checkpoint-epochs", f"--run-dir={run}"]


def measured(case: str, n: int, steps: int, data: str | None, cache: str, root: str) -> dict:
    """Median step times of `mpidl train` at ``n`` ranks on this node."""
    from mpidl.testing.launch import launch_env, mpiexec_command

    run = os.path.join(root, f"{case}-{n}")
    cmd = mpiexec_command(n, [sys.executable, "-m", *_train_args(case, steps, data, cache, run)])
    done = subprocess.run(cmd, env=launch_env(), cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{case} at {n} ranks failed:\n{done.stderr[-2000:]}")
    return _medians(run)


def _cluster(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", CLUSTER, *args], env=env, cwd=ROOT, capture_output=True,
                          text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"cluster.sh {' '.join(args[:4])} ... failed "
                           f"({done.returncode}):\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    return done


@contextlib.contextmanager
def cluster(nodes: int, rate: str, root: str) -> Iterator[dict]:
    """The virtual cluster, up for the block with one slot per node, down after it."""
    env = dict(os.environ, **CLUSTER_ENV, **ONE_THREAD,
               MPIDL_CLUSTER_DIR=os.path.join(root, "cluster"),
               MPIDL_PROFILE_DIR=os.path.join(root, "profiles"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    try:
        _cluster("up", "--nodes", str(nodes), "--rate", rate, "--slots", "1", env=env)
        yield env
    finally:
        _cluster("down", env=env, check=False)


def across_nodes(args: argparse.Namespace, root: str) -> list[dict]:
    """Bench, train and plan on the virtual cluster at ``args.rate``."""
    nodes = sorted(int(n) for n in args.nodes.split(","))
    cases = args.cases.split(",")
    cache = os.path.join(root, "cache")
    data = _mlp_data(root) if "mlp" in cases else None
    cores = len(os.sched_getaffinity(0))
    rows = []
    with cluster(max(nodes), args.rate, root) as env:
        # A fresh profile: bench keeps an old one's curves at other rank counts.
        old = os.path.join(env["MPIDL_PROFILE_DIR"], "network", f"{PROFILE}.toml")
        if os.path.exists(old):
            os.remove(old)
        # The network at 2 nodes, a rank on each of this machine's cores; --cores tells
        # the plan that 3 nodes share them (3 ranks benched on 2 cores would measure
        # the cores' sharing into the network's curve, and the plan would count it twice).
        bench = _cluster("mpiexec", "--nodes", "2", "-n", "2", *EXPORT, "mpidl", "bench",
                         "--op", "allreduce,iallreduce", "--min-bytes", "4KiB", "--max-bytes", "16MiB",
                         "--factor", "2", "--windows", "3", "--save-profile", PROFILE, env=env)
        print("\n".join(line for line in bench.stdout.splitlines()
                        if line.startswith("#") or line.strip()[:1].isdigit()), flush=True)
        for case in cases:
            runs = {}
            for n in nodes:
                run = os.path.join(root, f"{args.rate}-{case}-{n}")
                _cluster("mpiexec", "--nodes", str(n), "-n", str(n), *EXPORT,
                         *_train_args(case, args.steps, data, cache, run), env=env)
                runs[n] = _medians(run)
            plan = predicted(case, nodes, data, cache, ["--network", PROFILE,
                                                        "--ranks-per-node", "1",
                                                        "--cores", str(cores)], env=env)
            for n in nodes:
                rows.append(_row(case, n, n, plan[n], runs[n], n > cores, args.rate))
    return rows


def one_node(args: argparse.Namespace, root: str) -> list[dict]:
    ranks = [int(r) for r in args.ranks.split(",")]
    cores = len(os.sched_getaffinity(0))
    cache = os.path.join(root, "cache")
    data = _mlp_data(root) if "mlp" in args.cases else None
    rows = []
    for case in args.cases.split(","):
        plan = predicted(case, ranks, data, cache, ["--ranks-per-node", str(max(ranks)),
                                                    "--node-network", "shm"],
                         probe=2 if args.probe else 0)
        for n in ranks:
            m = measured(case, n, args.steps, data, cache, root)
            rows.append(_row(case, n, 1, plan[n], m, n > cores, "shm"))
    return rows


def _row(case: str, ranks: int, nodes: int, plan: dict, m: dict, over: bool,
         link: str) -> dict:
    row = {"model": case, "ranks": ranks, "nodes": nodes, "link": link,
           "oversubscribed": over,
           "predicted_ms": plan["step_s"] * 1e3, "measured_ms": m["step"] * 1e3,
           "predicted_compute_ms": plan["compute_s"] * 1e3,
           "measured_compute_ms": m["compute"] * 1e3,
           "predicted_comm_ms": (plan["exposed_comm_s"] + plan.get("fixed_s", 0.0)) * 1e3,
           "priced_comm_ms": plan["comm_s"] * 1e3, "measured_comm_ms": m["comm"] * 1e3,
           "overlap_share": plan["overlap_share"], "fixed_from": plan["fixed_from"]}
    row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
    print(json.dumps(row), flush=True)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="bow,transformer,mlp")
    p.add_argument("--ranks", default="1,2,3", help="one node: the rank counts")
    p.add_argument("--probe", action="store_true", help="one node: plan under mpiexec -n 2, "
                   "probing the fixed cost of a distributed step")
    p.add_argument("--rate", help="across nodes: shape the virtual cluster's links to RATE "
                   "(a tc rate: 1gbit, 200mbit)")
    p.add_argument("--nodes", default="1,2,3", help="across nodes: the node counts")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--work", help="keep the datasets here between runs (default: a "
                   "temporary folder)")
    args = p.parse_args(argv)
    # A SIGTERM (a timeout) unwinds like an error, so the cluster still goes down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with contextlib.ExitStack() as stack:
        root = args.work or stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(root, exist_ok=True)
        rows = across_nodes(args, root) if args.rate else one_node(args, root)
    print("\n| model | link | nodes x ranks | predicted step ms (compute + exchange) | "
          "measured step ms (compute + exchange) | error |\n|---|---|---|---|---|---|")
    for r in rows:
        mark = " (oversubscribed)" if r["oversubscribed"] else ""
        print(f"| {r['model']} | {r['link']} | {r['nodes']} x {r['ranks'] // r['nodes']}{mark} | "
              f"{r['predicted_ms']:.1f} ({r['predicted_compute_ms']:.1f} + "
              f"{r['predicted_comm_ms']:.1f}) | {r['measured_ms']:.1f} "
              f"({r['measured_compute_ms']:.1f} + {r['measured_comm_ms']:.1f}) | "
              f"{r['error']:+.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
