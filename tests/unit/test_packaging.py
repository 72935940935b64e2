"""A wheel (a non-editable install) carries what the package needs outside its modules:
the Slurm templates, the presets and the site profiles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
           "-w", str(out), ROOT]
    build = os.path.join(ROOT, "build")  # setuptools builds in the source tree
    had_build = os.path.exists(build)
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    finally:
        if not had_build:
            shutil.rmtree(build, ignore_errors=True)
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
    # through the source tree, which a real install does not have).
    prefix = tmp_path / "prefix"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--prefix",
                    str(prefix), str(wheel)], check=True, capture_output=True, timeout=300)
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
    assert found.split(",") == sorted(t[:-7] for t in templates if t.endswith(".sbatch"))
