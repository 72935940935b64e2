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


def _run_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("suite_run", RUN)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run


def _tiers(*argv):
    run = _run_module()
    parser = argparse.ArgumentParser()
    for flag in ("--quick", "--slurm", "--cluster", "--many", "--extras", "--all"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--mpi")
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
    assert _tiers("--extras") == (["tests/integration", "tests/unit"], [], [])  # marked `extra`
    assert _tiers("--sizes", "2") == ([], [2], [])  # the MPI tests only
    assert _tiers("--many-sizes", "16") == ([], [], [16])
    mpich = _tiers("--mpi", "mpich")  # in .venv-mpich: the launcher's tests, MPI at 2 and 3
    assert mpich[1:] == ([2, 3], []) and "tests/integration/test_preemption.py" in mpich[0]
    assert all(os.path.isfile(os.path.join(ROOT, p)) for p in mpich[0]), mpich
    single, sizes, many = _tiers("--all")
    assert (sizes, many) == ([1, 2, 3], [8, 16])
    # A new folder of tests must join a tier (tests/gpu needs a GPU: run by hand there).
    tests = os.path.join(ROOT, "tests")
    folders = {f"tests/{d}" for d in os.listdir(tests) if os.path.isdir(os.path.join(tests, d))
               and any(f.startswith("test_") for f in os.listdir(os.path.join(tests, d)))}
    assert folders - {"tests/gpu"} == set(single) | {"tests/mpi"}, folders


def _compile_in_child(module_dir):
    # A child process imports a module from module_dir, as the suite's launches import mpidl.
    return subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "import probe_module; print(sys.pycache_prefix or '')", module_dir],
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()


def test_the_run_keeps_compiled_bytecode_in_a_folder_of_its_own_then_removes_it(
        tmp_path, monkeypatch):
    run = _run_module()
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "probe_module.py").write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    with run.bytecode_cache():
        prefix = os.environ["PYTHONPYCACHEPREFIX"]
        assert "PYTHONDONTWRITEBYTECODE" not in os.environ
        assert _compile_in_child(str(sources)) == prefix
        compiled = [f for _, _, files in os.walk(prefix) for f in files]
        assert any(f.startswith("probe_module.") and f.endswith(".pyc") for f in compiled), compiled
    # Nothing beside the sources, the folder gone, the environment as it was.
    assert sorted(os.listdir(sources)) == ["probe_module.py"]
    assert not os.path.exists(prefix)
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "PYTHONPYCACHEPREFIX" not in os.environ
    # A prefix the caller chose is theirs; without PYTHONDONTWRITEBYTECODE nothing changes.
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "theirs"))
    with run.bytecode_cache():
        assert os.environ["PYTHONPYCACHEPREFIX"] == str(tmp_path / "theirs")
        assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    with run.bytecode_cache():
        assert "PYTHONPYCACHEPREFIX" not in os.environ
