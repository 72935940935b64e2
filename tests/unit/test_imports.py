"""Importing mpidl has no side effects; the layers depend on each other one way only."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("statement", [
    "import mpidl",
    "import mpidl, mpidl.comm, mpidl.backend, mpidl.cli, mpidl.testing",
])
def test_import_mpidl_loads_no_mpi_gpu_or_hdf5(statement):
    loaded = _modules_after(statement)
    assert not {"mpi4py", "cupy", "h5py"} & loaded, sorted({"mpi4py", "cupy", "h5py"} & loaded)


def test_import_hpc_never_imports_mpidl():
    loaded = _modules_after("import hpc, hpc.env")
    assert not any(m == "mpidl" or m.startswith("mpidl.") for m in loaded)


def _sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def test_only_the_backend_imports_cupy():
    pattern = re.compile(r"^\s*(import cupy|from cupy)", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in _sources("mpidl")
                 if pattern.search(p.read_text()) and p.name != "backend.py"]
    assert offenders == []


def test_hpc_sources_do_not_import_mpidl():
    pattern = re.compile(r"^\s*(import mpidl|from mpidl)", re.M)
    offenders = [str(p.relative_to(ROOT)) for p in _sources("hpc") if pattern.search(p.read_text())]
    assert offenders == []


def test_the_way_to_the_train_commands_signal_handlers_loads_no_numpy():
    # `mpidl train` installs its SIGTERM/SIGUSR1 handlers first; a signal before then kills
    # the rank (status 138, not 75), so what runs before them must stay light.
    loaded = _modules_after("import mpidl.cli, mpidl.excepthook, mpidl.comm.watchdog, "
                            "mpidl.train.command, mpidl.train.signals, hpc.launch")
    assert "numpy" not in loaded


def test_the_lazy_public_names_still_import():
    loaded = _modules_after("from mpidl import Tensor, no_grad\n"
                            "from mpidl.train import PreemptionFlag, Config, format_table")
    assert "mpidl.autograd" in loaded and "mpidl.train.config" in loaded
