"""A virtual environment of mpidl with another MPI: MPICH's or Intel MPI's wheel, no Open MPI.

mpi4py's binary wheel loads whichever ``libmpi`` it finds: the ``mpich`` wheel gives it
MPICH (and Hydra's ``mpiexec``), ``impi-rt`` Intel MPI, both through the MPICH ABI. So a
second environment beside the main one, ``.venv-mpich`` (``.venv-impi``) at the
repository root, holds mpidl (editable, this checkout), its test extra and that wheel,
and never Open MPI's. ``tests/run.py --mpi mpich`` runs its tier there; the virtual
cluster uses ``.venv-mpich/bin/python`` when it exists::

    python tests/mpienv.py mpich        # make it (or reuse it); prints its python

Made once (about 2 minutes with pip's cache warm, more for impi-rt's 130 MB on the first
download), then reused while the package's metadata and the wheel's name are unchanged.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

# The wheel for each MPI, and what its library calls itself (MPI_Get_library_version):
# the check that mpi4py loads that MPI and not another one found on the library path.
WHEELS = {"mpich": ("mpich", "MPICH Version"),
          "impi": ("impi-rt", "Intel(R) MPI Library")}
# Written last into the environment: what it was made from; reuse only when it matches.
STAMP = "mpidl-mpienv.stamp"
INSTALL_TIMEOUT_S = 1200


def venv_dir(root: os.PathLike | str, mpi: str) -> Path:
    """Where ``mpi``'s environment lives: ``<root>/.venv-<mpi>``."""
    return Path(root) / f".venv-{mpi}"


def _stamp(root: Path, mpi: str) -> str:
    """What the environment depends on: the wheel, the Python, mpidl's metadata files."""
    h = hashlib.sha256(f"{WHEELS[mpi][0]} {sys.version}".encode())
    for name in ("setup.cfg", "pyproject.toml", "setup.py"):
        path = root / name
        if path.exists():
            h.update(name.encode() + path.read_bytes())
    return h.hexdigest()


def library_version(python: os.PathLike | str) -> str:
    """The MPI library that mpi4py loads in ``python``'s environment (one process, no
    launcher: MPI starts as a singleton)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(python), "-c", "from mpi4py import MPI; "
                          "print(MPI.Get_library_version())"],
                         capture_output=True, text=True, timeout=120, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{python}: mpi4py does not load an MPI: {out.stderr.strip()[-2000:]}")
    return out.stdout


def ensure_venv(root: os.PathLike | str, mpi: str, *, log=print) -> Path:
    """The Python of ``mpi``'s environment at ``root`` (``"mpich"`` or ``"impi"``), made
    with ``pip install -e '.[test]' WHEEL`` when missing or stale, then checked: mpi4py
    must load that MPI. Raises ``ValueError`` for an unknown MPI and ``RuntimeError``
    (with pip's or mpi4py's words) when the environment cannot be made."""
    if mpi not in WHEELS:
        raise ValueError(f"unknown MPI {mpi!r}: choose one of {', '.join(WHEELS)}")
    root = Path(root).resolve()
    venv = venv_dir(root, mpi)
    python = venv / "bin" / "python"
    wheel, name = WHEELS[mpi]
    stamp, want = venv / STAMP, _stamp(root, mpi)
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        log(f"mpienv: reusing {venv}")
    else:
        start = time.monotonic()
        log(f"mpienv: making {venv}: pip install -e '.[test]' {wheel}")
        stamp.unlink(missing_ok=True)
        steps = [[sys.executable, "-m", "venv", str(venv)],
                 [str(python), "-m", "pip", "install", "-q", "-e", ".[test]", wheel]]
        for cmd in steps:
            out = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                                 timeout=INSTALL_TIMEOUT_S)
            if out.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n"
                                   f"{(out.stdout + out.stderr)[-4000:]}")
        log(f"mpienv: made {venv} in {time.monotonic() - start:.0f} s")
    version = library_version(python)
    if name not in version:
        raise RuntimeError(f"{python}: mpi4py loads {version.splitlines()[0]!r}, not {name}: "
                           f"another libmpi on LD_LIBRARY_PATH? (remove {venv} to remake it)")
    stamp.write_text(want)
    return python


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in WHEELS:
        print(f"usage: python tests/mpienv.py {{{','.join(WHEELS)}}}", file=sys.stderr)
        sys.exit(2)
    print(ensure_venv(Path(__file__).resolve().parent.parent, sys.argv[1],
                      log=lambda s: print(s, file=sys.stderr)))
