"""The planner's network profile measured across virtual nodes, and a plan priced with it.

`mpidl bench --save-profile` with one rank on each of two nodes (TCP over the shaped veth
links) writes a profile whose curves are the cross-node sweep, and `mpidl plan --network`
prices the rows of 2 and 3 nodes with those curves. How close the plan comes to real
runs is timing, measured by `benchmarks/plan_check.py --rate` on a quiet machine
(docs/cluster.md), never asserted here. About 10 s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpc.costmodel import load_network

pytestmark = [pytest.mark.timeout(300)]


def test_a_profile_benched_across_nodes_prices_the_plans_rows_of_several_nodes(cluster,
                                                                             tmp_path):
    env = {"MPIDL_PROFILE_DIR": str(tmp_path / "profiles"), "OMP_NUM_THREADS": "1"}
    bench = cluster.mpiexec((2, 1), [
        sys.executable, "-m", "mpidl", "bench", "--op", "allreduce,iallreduce",
        "--min-bytes", "4KiB", "--max-bytes", "256KiB", "--factor", "4", "--windows", "2",
        "--iters", "3", "--warmup", "1", "--save-profile", "virtual"], env=env)
    assert bench.returncode == 0, bench.output
    assert "# hpc.bench allreduce: 2 ranks on 2 node(s)" in bench.output, bench.output
    assert "# hpc.bench iallreduce: 2 ranks on 2 node(s)" in bench.output, bench.output
    saved = tmp_path / "profiles" / "network" / "virtual.toml"
    assert saved.is_file(), bench.output
    profile = load_network(str(saved))
    for op in ("allreduce", "iallreduce"):
        curves = dict(profile.links[op].curves)
        assert sorted(curves) == [2], (op, curves)  # measured at 2 ranks, on 2 nodes
        assert [n for n, _ in curves[2]] == [4096, 16384, 65536, 262144], (op, curves)
    # The plan (one process here) prices 2 and 3 nodes with it: not the shipped 10gbe's.
    rows = {network: plan(tmp_path, network, env) for network in ("virtual", "10gbe")}
    for n in (2, 3):
        ours, shipped = rows["virtual"][n], rows["10gbe"][n]
        assert ours["nodes"] == n and ours["comm_s"] > 0
        assert ours["comm_s"] != pytest.approx(shipped["comm_s"], rel=0.05), (ours, shipped)
    assert rows["virtual"][1]["comm_s"] == 0.0


def plan(tmp_path, network, env):
    out = tmp_path / f"plan-{network}.json"
    done = subprocess.run(
        [sys.executable, "-m", "mpidl", "plan", "reviews", f"--data.cache-dir={tmp_path}",
         "--ranks", "1,2,3", "--network", network, "--step-time", "0.01", "--json",
         str(out)], capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"network: {network} between nodes" in done.stdout, done.stdout
    return {r["ranks"]: r for r in json.loads(out.read_text())["rows"]}
