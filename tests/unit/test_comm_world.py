"""world() picks the communicator from how the process was started."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = "from mpidl.comm import world; w = world(); print(type(w).__name__, w.size)"


def _run(extra_env):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI", "SLURM_", "PMIX_", "MPIDL_"))}
    env.update(extra_env)
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                          env=env, timeout=60)


def test_plain_python_gets_a_single_communicator_without_importing_mpi():
    out = _run({})
    assert out.returncode == 0 and out.stdout.split() == ["SingleCommunicator", "1"]


def test_slurm_tasks_that_mpi_does_not_join_are_refused():
    # What `srun --mpi=pmi2` with a PMIx-only MPI looks like from inside one task.
    pytest.importorskip("mpi4py")
    out = _run({"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0",
                "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "MPIDL_COMM": "mpi"})
    assert out.returncode == 1 and out.stdout == "", out.stderr
    assert "LaunchError: the launcher (slurm) started 2 processes" in out.stderr
    assert "sees a world of size 1 in each" in out.stderr and "--mpi=" in out.stderr
