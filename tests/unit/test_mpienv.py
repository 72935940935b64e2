"""tests/mpienv.py: the environment of another MPI is reused while what it was made from is
unchanged, and refused when mpi4py loads another MPI than the one it was made for."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mpienv():
    spec = importlib.util.spec_from_file_location("mpienv", os.path.join(ROOT, "tests",
                                                                         "mpienv.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checkout_with_a_venv(tmp_path, mpienv, says):
    """A checkout whose .venv-mpich holds a stand-in python: its mpi4py "loads" ``says``."""
    (tmp_path / "setup.cfg").write_text("[metadata]\nname = mpidl\n")
    python = mpienv.venv_dir(tmp_path, "mpich") / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho '{says}'\necho ran >> '{python}.log'\n")
    python.chmod(0o755)
    return python


def test_a_made_environment_is_reused_while_setup_cfg_is_unchanged(tmp_path):
    mpienv = _mpienv()
    python = _checkout_with_a_venv(tmp_path, mpienv, "MPICH Version:      5.0.2")
    (python.parent.parent / mpienv.STAMP).write_text(mpienv._stamp(tmp_path, "mpich"))
    said = []
    assert mpienv.ensure_venv(tmp_path, "mpich", log=said.append) == python
    assert said == [f"mpienv: reusing {python.parent.parent}"]
    # Changed metadata (a new dependency) makes it stale: it is made again.
    (tmp_path / "setup.cfg").write_text("[metadata]\nname = mpidl\nversion = 2\n")
    assert mpienv._stamp(tmp_path, "mpich") != (python.parent.parent / mpienv.STAMP).read_text()


def test_an_environment_whose_mpi4py_loads_another_mpi_is_refused(tmp_path):
    mpienv = _mpienv()
    python = _checkout_with_a_venv(tmp_path, mpienv, "Open MPI v5.0.11")
    (python.parent.parent / mpienv.STAMP).write_text(mpienv._stamp(tmp_path, "mpich"))
    with pytest.raises(RuntimeError, match=r"loads 'Open MPI v5.0.11', not MPICH Version"):
        mpienv.ensure_venv(tmp_path, "mpich", log=lambda s: None)


def test_an_unknown_mpi_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="choose one of mpich, impi"):
        _mpienv().ensure_venv(tmp_path, "mvapich")
