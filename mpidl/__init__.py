"""mpidl: distributed deep-learning training for HPC machines.

A pure-array neural-network engine (NumPy on CPU, CuPy on GPU, the same code) trained
across many processes with MPI. Importing mpidl has no side effects: it does not import
mpi4py, cupy or h5py, and never initialises MPI or a GPU; the modules that need them
import them.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["Tensor", "Function", "no_grad", "is_grad_enabled", "__version__"]

# The public names are imported on first use (PEP 562): `import mpidl.cli` must not pay
# NumPy's 0.2 s, because `mpidl train` installs its SIGTERM/SIGUSR1 handlers only once
# its own module runs, and a signal before that kills the rank (status 138) instead of
# stopping it with 75 (mpidl.train.signals).
_LAZY = {"Tensor": "mpidl.autograd", "Function": "mpidl.autograd",
         "no_grad": "mpidl.autograd", "is_grad_enabled": "mpidl.autograd"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mpidl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
