"""`python -m hpc.bench` as users run it: under mpiexec, rank 0 alone prints the sweep."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

from hpc import bench
from mpidl.testing.launch import mpiexec

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
SMALL = ["--max-bytes", "65536", "--iters", "5", "--warmup", "2", "--windows", "2"]


def _bench(n: int, *args: str):
    result = mpiexec(n, [sys.executable, "-m", "hpc.bench", *SMALL, *args], timeout=120,
                     env=ENV, cwd=ROOT)
    assert result.returncode == 0, result.output
    return result


def test_json_sweep_on_two_ranks_prints_each_size_once_with_bandwidths():
    result = _bench(2, "--json")
    records = [json.loads(line) for line in result.stdout.splitlines()]  # every line JSON
    rows = [r for r in records if "fit" not in r]
    assert [r["bytes"] for r in rows] == bench.message_sizes(4, 65536), result.stdout
    for r in rows:
        assert (r["op"], r["ranks"], r["dtype"], r["windows"]) == ("allreduce", 2, "float32", 2)
        assert r["busbw_GBps"] > 0 and r["algbw_GBps"] == pytest.approx(r["busbw_GBps"])
        assert r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
        assert 1 <= r["iters"] <= 5
    fits = [r for r in records if "fit" in r]
    assert len(fits) == 1 and fits[0]["alpha_us"] >= 0 and fits[0]["sizes"] == len(rows)


def test_table_of_every_op_on_three_ranks():
    result = _bench(3, "--op", "all")
    out = result.stdout
    headers = re.findall(r"^# hpc\.bench (\w+): 3 ranks on 1 node\(s\)", out, re.M)
    assert headers == list(bench.OPS), out
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s", out, re.M)
    # allreduce, iallreduce, bcast and sendrecv: every size; allgather/reduce_scatter/
    # alltoall: whole vectors of 3 x elements, so 4 B and 16 B both round to 12 B and
    # appear once.
    assert len(rows) == 4 * 8 + 3 * 7, out
    assert len(re.findall(r"^# fit over \d+ sizes", out, re.M)) == 7, out


def test_bad_argument_is_reported_once_and_fails_every_rank():
    result = mpiexec(2, [sys.executable, "-m", "hpc.bench", "--op", "scan"], timeout=60,
                     env=ENV, cwd=ROOT)
    assert result.returncode == 2, result.output
    assert result.stderr.count("unknown ['scan']") == 1, result.output
