"""A wheel (a non-editable install) carries what the package needs outside its modules:
the Slurm templates, the presets and the site profiles.

The test leaves the environment it runs in as it found it: the wheel is built from a
copy of the source tree and installed into a prefix of its own, never over the
environment's mpidl.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

# Building the wheel (up to 300 s allowed below) runs in the first test's 120 s on a loaded
# machine: past it, pytest-timeout's thread method ends the whole xdist worker.
pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _suite_runner():
    """tests/run.py, whose installation check this test must leave passing."""
    spec = importlib.util.spec_from_file_location("suite_runner", os.path.join(ROOT, "tests",
                                                                               "run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # setuptools writes build/ and *.egg-info where it builds, and a stale build/ would
    # end up in the wheel: build from a copy, so nothing is written into the checkout.
    src = tmp_path_factory.mktemp("source") / "mpidl"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        "runs", ".mpidl-cache"))
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
           "-w", str(out), str(src)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and "No module named" in run.stderr:
        pytest.skip(f"cannot build a wheel here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr
    (path,) = out.glob("mpidl-*.whl")
    return path


@pytest.mark.slow
def test_the_wheel_carries_templates_presets_and_profiles(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    templates = sorted(f for f in os.listdir(os.path.join(ROOT, "slurm")) if f[0] != ".")
    for t in templates:
        assert f"mpidl-0.1.0.data/data/share/mpidl/slurm/{t}" in names, t
    assert any(n.startswith("mpidl/presets/") and n.endswith(".toml") for n in names)
    assert any(n.startswith("hpc/profiles/") and n.endswith(".toml") for n in names)

    # Installed into a prefix of its own, `hpc.sbatch` finds the templates there (and not
    # through the source tree, which a real install does not have). Without
    # --ignore-installed, pip first uninstalls the mpidl of the environment it runs in
    # (the venv lost mpidl and its console script on every test run).
    runner = _suite_runner()
    before = runner.installation_problems(sys.executable)
    prefix = tmp_path / "prefix"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--ignore-installed", "--prefix", str(prefix), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    after = runner.installation_problems(sys.executable)
    assert after == before, f"installing into {prefix} changed this environment: {after}"
    site = next(prefix.glob("lib/python*/site-packages"))
    probe = (
        "import sys; sys.prefix = sys.argv[1]; from hpc import sbatch;"
        "print(sbatch.__file__); print(','.join(sbatch.list_templates()))"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("MPIDL_SLURM_DIR", None)
    run = subprocess.run([sys.executable, "-c", probe, str(prefix)], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=60, check=True)
    where, found = run.stdout.split()
    assert where.startswith(str(site))
    assert found.split(",") == sorted(os.path.splitext(t)[0] for t in templates
                                      if t.endswith((".sbatch", ".pbs")))
