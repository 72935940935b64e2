"""Session fixture: a real single-node Slurm for the tests in this folder.

See slurmci.py for how the cluster is run and how jobs are submitted and polled. The
whole folder is skipped, with the reason, only where Slurm is not installed and cannot
be installed here; a cluster that is installed but does not start is an error.
"""
from __future__ import annotations

import shutil
import subprocess
from typing import Iterator

import pytest

from slurmci import CI_DIR, HERE, TOOLS, Cluster, unavailable


@pytest.fixture(scope="session")
def slurm() -> Iterator[Cluster]:
    """The running local cluster; started for the session and stopped after it."""
    reason = unavailable()
    if reason is None and any(shutil.which(t) is None for t in TOOLS):
        # Installable here (root + apt-get): install, as CI's .ci/run would have.
        proc = subprocess.run([str(HERE / "install.sh")], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            reason = f"tests/slurm/install.sh failed: {proc.stderr.strip()[-500:]}"
    if reason is not None:
        pytest.skip(reason)
    try:
        proc = subprocess.run([str(HERE / "cluster.sh")], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("tests/slurm/cluster.sh did not finish in 120 s; see "
                    f"{CI_DIR}/log/*.log")
    if proc.returncode != 0:
        pytest.fail(f"tests/slurm/cluster.sh failed ({proc.returncode}):\n"
                    f"{proc.stdout}\n{proc.stderr}")
    started = proc.stdout.strip().endswith("cluster: started")
    try:
        yield Cluster(CI_DIR / "slurm.conf")
    finally:
        if started:
            subprocess.run([str(HERE / "down.sh")], capture_output=True, timeout=60)


@pytest.fixture(autouse=True)
def _needs_slurm(slurm: Cluster) -> None:
    """Every test here needs the cluster (the session fixture skips them all if none)."""
