"""The local rank comes from MPI where no launcher variable gives it.

Each rank is started through a wrapper that removes every launcher's local-rank and
local-size variables (hpc.env.LOCAL_VARS) and names its node, so that ranks 0, 2, ...
share "node0" and ranks 1, 3, ... "node1": a layout no variable describes, which MPI's
shared-memory split, checked against the node names (hpc.env.split_nodes), finds.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from mpidl.testing.launch import mpiexec

pytest.importorskip("mpi4py")
pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A rank's wrapper: drop the local-rank variables, name the node by the rank's parity,
# write what detect() then knows (in BEFORE_DIR), and become `mpidl info --json`.
WRAPPER = """
import json, os, sys
from hpc import env
rank = env.detect().rank
for name in env.LOCAL_VARS:
    os.environ.pop(name, None)
os.environ["SLURMD_NODENAME"] = f"node{rank % 2}"
after = env.detect()
with open(os.path.join(os.environ["BEFORE_DIR"], f"{rank}.json"), "w") as f:
    json.dump({"rank": rank, "local_from": after.local_from}, f)
os.execv(sys.executable, [sys.executable, "-m", "mpidl", "info", "--json", "--no-probe"])
"""


@pytest.mark.parametrize("n", [2, 3])
def test_local_ranks_without_launcher_variables_come_from_mpi(n, tmp_path):
    # Three devices per node: the device a rank binds is its local rank.
    result = mpiexec(n, [sys.executable, "-c", WRAPPER], timeout=150, cwd=ROOT,
                     env={"PYTHONPATH": ROOT, "CUDA_VISIBLE_DEVICES": "0,1,2",
                          "BEFORE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.output
    # Before MPI, nothing said where the ranks were: detect() assumed, and said so.
    before = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert sorted(b["rank"] for b in before) == list(range(n)), result.stderr
    assert all(b["local_from"] is None for b in before), before
    report = json.loads(result.stdout)
    assert report["nodes"] == 2 and report["nodes_found_by"] == "node name"
    for r in report["per_rank"]:
        same_node = [q for q in range(n) if q % 2 == r["rank"] % 2]
        expected = same_node.index(r["rank"])
        assert (r["node"], r["local_rank"], r["local_size"]) == \
            (f"node{r['rank'] % 2}", expected, len(same_node)), report["per_rank"]
        # mpidl binds by this local rank, as mpidl train does, not by detect()'s guess.
        assert r["device"] == expected, report["per_rank"]
