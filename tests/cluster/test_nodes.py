"""Across virtual nodes, MPI and mpidl see the nodes that are there: `mpidl info` names
every node and its local ranks, and the ranks of one node share its host name."""
from __future__ import annotations

import json
import sys

import pytest

pytestmark = [pytest.mark.timeout(300)]


def info(cluster, layout):
    result = cluster.mpiexec(layout, [sys.executable, "-m", "mpidl", "info", "--json",
                                      "--no-probe"], timeout=120)
    assert result.returncode == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("layout,per_node", [((2, 2), {"n1": 2, "n2": 2}),
                                             ((3, 1), {"n1": 1, "n2": 1, "n3": 1})])
def test_mpidl_info_names_every_node_and_its_local_ranks(cluster, layout, per_node):
    report = info(cluster, layout)
    assert report["ranks"] == sum(per_node.values())
    assert report["nodes"] == len(per_node)
    assert report["ranks_per_node"] == per_node
    ranks = report["per_rank"]
    for r in ranks:
        same_node = [o["rank"] for o in ranks if o["host"] == r["host"]]
        assert (r["local_rank"], r["local_size"]) == (same_node.index(r["rank"]),
                                                      len(same_node)), r
    # each node's ranks follow one another: tensor groups of consecutive ranks stay inside
    assert [r["host"] for r in ranks] == sorted(r["host"] for r in ranks)
