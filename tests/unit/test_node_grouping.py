"""hpc.env.group_nodes: MPI's shared-memory split is used where it matches the node names;
where it does not (srun --mpi=pmix giving every rank a split of its own), the names."""
from __future__ import annotations

import pytest

from hpc.env import group_nodes, node_name


def test_a_split_that_matches_the_node_names_is_used():
    g = group_nodes(["n1", "n1", "n2", "n2"], [0, 0, 2, 2])
    assert (g.by, g.nodes, g.names, g.shared_memory, g.reason) == \
        ("shared memory", (0, 0, 1, 1), ("n1", "n2"), True, "")


def test_nodes_are_numbered_by_their_lowest_rank_whatever_the_names():
    g = group_nodes(["b", "a", "b", "a"], [0, 1, 0, 1])
    assert g.by == "shared memory" and g.nodes == (0, 1, 0, 1) and g.names == ("b", "a")


def test_a_rank_per_split_on_shared_hosts_is_grouped_by_name_without_shared_memory():
    # srun --mpi=pmix on 2 nodes x 2 tasks: COMM_TYPE_SHARED of size 1 on every rank
    g = group_nodes(["n1", "n1", "n2", "n2"], [0, 1, 2, 3])
    assert g.by == "node name" and g.nodes == (0, 0, 1, 1) and g.names == ("n1", "n2")
    assert not g.shared_memory
    assert "split found 4 node(s), the node names 2 (n1, n2)" in g.reason
    assert "without shared memory" in g.reason


def test_a_split_wider_than_the_names_is_grouped_by_name_and_keeps_shared_memory():
    # one shared-memory domain holding two named nodes: each name's ranks still share it
    g = group_nodes(["n1", "n1", "n2"], [0, 0, 0])
    assert g.by == "node name" and g.nodes == (0, 0, 1) and g.shared_memory
    assert "without shared memory" not in g.reason


@pytest.mark.parametrize("size", [1, 3])
def test_one_rank_per_node_agrees(size):
    g = group_nodes([f"n{r}" for r in range(size)], list(range(size)))
    assert g.by == "shared memory" and g.nodes == tuple(range(size))


def test_the_node_name_is_slurms_where_srun_says_it_else_the_host_name():
    import socket

    assert node_name({"SLURMD_NODENAME": "vn2"}) == "vn2"
    assert node_name({"SLURMD_NODENAME": ""}) == socket.gethostname()
    assert node_name({}) == socket.gethostname()


def test_mpidl_info_says_how_the_nodes_were_found():
    from mpidl.info import format_report

    rank = {"rank": 0, "host": "n1", "node": "n1", "pid": 1, "local_rank": 0,
            "local_size": 2, "omp_num_threads": None, "cpus": 1,
            "cuda_visible_devices": None, "gpus": None, "device": None, "device_name": None,
            "pci_bus_id": None, "error": None}
    report = {"mpidl": "0", "python": "3", "mpi": {"library": "MPI", "standard": "3.1",
                                                    "in_use": True},
              "ranks": 2, "nodes": 1, "ranks_per_node": {"n1": 2},
              "nodes_found_by": "node name", "nodes_note": "MPI's split found 2",
              "job": {"id": None, "launcher": "openmpi"},
              "cuda_aware": {"aware": None, "reason": "-", "cases": {}},
              "versions": {}, "blas": [], "per_rank": [rank, dict(rank, rank=1)]}
    assert "nodes found by: node name (MPI's split found 2)" in format_report(report)
    report["nodes_found_by"] = "shared memory"
    assert "nodes found by: MPI's shared-memory split" in format_report(report)
    report["per_rank"][1] = dict(rank, rank=1, node="vn2")
    assert "rank 1 on vn2 (host n1)" in format_report(report)
