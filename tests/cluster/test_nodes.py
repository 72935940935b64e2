"""Across virtual nodes, MPI and mpidl see the nodes that are there: `mpidl info` names
every node and its local ranks, and the ranks of one node share its host name; under
Open MPI and under MPICH (Hydra), each the library its ranks load."""
from __future__ import annotations

import json
import sys

import pytest

# the tiny float64 gpt of the layout tests, and the check against its single-rank run
from test_gpt_model_parallel import STEPS, gpt_cache, single  # noqa: F401  (fixtures)
from test_modes_across_nodes import assert_trains_like_one_rank, train

from clusterci import mpi as named, param

pytestmark = [pytest.mark.timeout(300)]

# The first words of MPI_Get_library_version under each MPI.
LIBRARY = {"openmpi": "Open MPI", "mpich": "MPICH"}


def info(cluster, layout, mpi=None):
    python = mpi.python if mpi else sys.executable
    result = cluster.mpiexec(layout, [python, "-m", "mpidl", "info", "--json", "--no-probe"],
                             timeout=120, mpi=mpi)
    assert result.returncode == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("mpi,layout,per_node", [
    param(name, layout, per_node, id=f"{layout[0]}x{layout[1]}")
    for name in ("openmpi", "mpich")
    for layout, per_node in (((2, 2), {"n1": 2, "n2": 2}), ((3, 1), {"n1": 1, "n2": 1, "n3": 1}))])
def test_mpidl_info_names_every_node_and_its_local_ranks(cluster, mpi, layout, per_node):
    mpi = named(mpi)
    report = info(cluster, layout, mpi)
    assert report["mpi"]["library"].startswith(LIBRARY[mpi.name]), report["mpi"]
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


# Runs its command under another host name: n1 and n2 become h1, n3 becomes h2. So MPI
# sees 3 nodes (a daemon each) and the host names say 2: what srun --mpi=pmix does when
# it gives every rank a shared-memory split of its own on a node of several ranks.
RENAME = """#!/bin/sh
case $(hostname) in n1|n2) name=h1 ;; *) name=h2 ;; esac
exec unshare --uts sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
"""


@pytest.fixture
def rename(tmp_path):
    path = tmp_path / "rename.sh"
    path.write_text(RENAME)
    path.chmod(0o755)
    return str(path)


def test_nodes_follow_the_host_names_where_mpis_split_disagrees(cluster, rename):
    result = cluster.mpiexec((3, 1), [rename, sys.executable, "-m", "mpidl", "info",
                                      "--json", "--no-probe"], timeout=120)
    assert result.returncode == 0, result.output
    report = json.loads(result.stdout)
    assert report["nodes_found_by"] == "node name"
    assert report["ranks_per_node"] == {"h1": 2, "h2": 1}
    assert [(r["local_rank"], r["local_size"]) for r in report["per_rank"]] == \
        [(0, 2), (1, 2), (0, 1)]
    # said once, by rank 0
    assert result.stderr.count("mpidl: note: MPI's shared-memory split found 3 node(s), "
                               "the node names 2 (h1, h2); grouping by node name, without "
                               "shared memory between a node's ranks") == 1, result.stderr


def test_a_node_found_by_name_trains_without_a_shared_memory_window(
        cluster, rename, tmp_path, gpt_cache, single):
    """Two ranks named h1 in two MPI nodes: one node for mpidl, but MPI shares no memory
    between them, so DataParallel's shared window (chosen when every rank is on one
    node) must be refused and MPI's allreduce used; the single-rank steps."""
    run = str(tmp_path / "run")
    result = train(cluster, (2, 1), run, gpt_cache, f"--steps={STEPS}", "--overlap=false",
                   prefix=[rename])
    assert result.returncode == 0, result.output
    assert_trains_like_one_rank(run, single, "2 ranks named h1")
