"""Session fixture: three virtual nodes (network + UTS namespaces) for the tests here.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2 or
util-linux). The cluster is brought down after the session, also when a test failed,
and the session fails if anything of it is left behind. Its state folder is fixed, so a
session killed before its teardown is cleaned up by the next one's first `down`.
"""
from __future__ import annotations

import sys
from typing import Iterator

import pytest

from clusterci import HERE, Cluster, brought_up, unavailable

# The helpers of the single-machine layout tests (a tiny float64 gpt, its metrics and
# checkpoints, one tolerance for "the same model"), shared rather than copied.
sys.path.insert(0, str(HERE.parent / "integration"))

NODES = 3


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Three nodes n1-n3 with 2 slots each, links shaped to 10 Gbit/s."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no virtual cluster here: {reason}")
    # 10gbit: the shaping path is exercised at a rate that costs the tests no time.
    with brought_up("mpidl-cluster-tests", NODES, "--slots", "2", "--rate", "10gbit") as made:
        yield made


@pytest.fixture(autouse=True)
def _needs_cluster(cluster: Cluster) -> None:
    """Every test here needs the cluster (the session fixture skips them all if none)."""
