"""tests/run.py fails a run after which mpidl is not usable in the environment it ran in
(a test that uninstalled it, or an environment where it was never installed)."""

from __future__ import annotations

import argparse
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


def _tiers(*argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_run", RUN)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    parser = argparse.ArgumentParser()
    for flag in ("--quick", "--slurm", "--cluster", "--many", "--all"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--sizes")
    parser.add_argument("--many-sizes")
    single, sizes, many = run.tiers(parser.parse_args(list(argv)))
    return sorted(p for paths in single.values() for p in paths), sizes, many


def test_each_flag_runs_its_tiers_and_all_runs_every_test_folder():
    assert _tiers() == (["tests/integration", "tests/unit"], [1, 2, 3], [])  # README's command
    assert _tiers("--quick") == (["tests/unit"], [2], [])
    assert _tiers("--slurm") == (["tests/slurm"], [], [])
    assert _tiers("--cluster") == (["tests/cluster"], [], [])
    assert _tiers("--many") == (["tests/many"], [], [8, 16])
    assert _tiers("--sizes", "2") == ([], [2], [])  # the MPI tests only
    assert _tiers("--many-sizes", "16") == ([], [], [16])
    single, sizes, many = _tiers("--all")
    assert (sizes, many) == ([1, 2, 3], [8, 16])
    # A new folder of tests must join a tier (tests/gpu needs a GPU: run by hand there).
    tests = os.path.join(ROOT, "tests")
    folders = {f"tests/{d}" for d in os.listdir(tests) if os.path.isdir(os.path.join(tests, d))
               and any(f.startswith("test_") for f in os.listdir(os.path.join(tests, d)))}
    assert folders - {"tests/gpu"} == set(single) | {"tests/mpi"}, folders
