"""tests/run.py fails a run after which mpidl is not usable in the environment it ran in
(a test that uninstalled it, or an environment where it was never installed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "tests", "run.py")


def suite(python, *args):
    # No test selected: what remains is the installation check.
    return subprocess.run([python, RUN, "--no-single", "--no-mpi", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_a_run_in_an_environment_without_mpidl_fails_and_says_why(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
                   check=True, capture_output=True, timeout=120)
    bare = str(tmp_path / "bare" / "bin" / "python")
    result = suite(bare)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any("mpidl is not usable in this environment" in line for line in lines), lines
    assert any("console script" in line and "bare" in line for line in lines), lines
    assert any("`import mpidl`" in line for line in lines), lines
    assert lines[-1] == "suite: 0 passed, 1 failed, 0 skipped"


def test_a_run_in_this_environment_passes_the_installation_check():
    result = suite(sys.executable)
    if "it was not installed" in result.stdout:
        pytest.skip("mpidl is not installed in this environment (pip install -e .)")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "suite: 0 passed, 0 failed, 0 skipped"
