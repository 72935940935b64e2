"""`mpidl info` as users run it: under mpiexec, rank 0 reports the size of the world once."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mpidl.testing.launch import launch_env, mpiexec

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


def ranks_lines(text):
    return re.findall(r"^ranks: (\d+)$", text, flags=re.M)


def test_info_on_two_ranks_reports_ranks_2_once():
    result = mpiexec(2, [sys.executable, "-m", "mpidl", "info"], timeout=90, env=ENV, cwd=ROOT)
    assert result.returncode == 0, result.output
    assert ranks_lines(result.stdout) == ["2"], result.output
    assert result.stdout.count("MPI library:") == 1  # rank 0 alone prints
    assert re.search(r"^ranks per node: \S+=", result.stdout, flags=re.M), result.stdout


def test_info_json_on_three_ranks_lists_every_rank():
    result = mpiexec(3, [sys.executable, "-m", "mpidl", "info", "--json"], timeout=90, env=ENV,
                     cwd=ROOT)
    assert result.returncode == 0, result.output
    report = json.loads(result.stdout)
    assert report["ranks"] == 3
    assert [r["rank"] for r in report["per_rank"]] == [0, 1, 2]
    assert sum(report["ranks_per_node"].values()) == 3
    assert report["mpi"]["in_use"] is True


def test_info_without_a_launcher_is_size_one():
    env = {k: v for k, v in launch_env(ENV).items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_"))}
    result = subprocess.run([sys.executable, "-m", "mpidl", "info"], capture_output=True,
                            text=True, timeout=90, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert ranks_lines(result.stdout) == ["1"], result.stdout
