"""Communication: MPI-named, buffer-based collectives on NumPy and CuPy arrays.

``world()`` is the entry point::

    import mpidl.comm as comm
    w = comm.world()                 # every rank of the job (size 1 without a launcher)
    w.allreduce_(grad)               # in place, on a numpy or cupy array
    w.check(ok, "what went wrong")   # raises on every rank if any rank failed

The MPI implementation wraps a ``Dup`` of ``COMM_WORLD``, never the caller's own
communicator. A process not started by an MPI launcher (or without mpi4py) gets a
size-1 :class:`SingleCommunicator`, so the same script runs as ``python train.py``.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from mpidl.comm.base import (
    Communicator,
    DistributedError,
    Request,
    split_counts,
)
from mpidl.comm.single import SingleCommunicator

_world: Communicator | None = None


def _want_mpi() -> bool:
    choice = os.environ.get("MPIDL_COMM", "auto").lower()
    if choice in ("single", "none", "1"):
        return False
    if choice == "mpi":
        return True
    if choice != "auto":
        raise ValueError(f"MPIDL_COMM={choice!r}: use 'auto', 'mpi' or 'single'")
    from hpc.env import is_mpi_launch

    import sys

    # An application that initialised MPI itself is an MPI launch whatever the env says.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return True
    return is_mpi_launch(os.environ)


def _say_how_nodes_were_found(comm: Any) -> None:
    """Rank 0 says so when the nodes are not MPI's shared-memory split (hpc.env)."""
    grouping = comm.node_grouping
    if grouping.by != "shared memory" and comm.rank == 0:
        print(f"mpidl: note: {grouping.reason}: {len(grouping.names)} node(s), "
              f"{comm.local_size} rank(s) on rank 0's node {grouping.names[0]}",
              file=sys.stderr, flush=True)


class LaunchError(RuntimeError):
    """The launcher started N processes but each sees a world of size 1 (exit status 2).

    Attributes:
        launcher_rank: this process's rank as the launcher numbered it, so that one of
            the N copies (rank 0) reports it, not all N.
    """

    def __init__(self, message: str, launcher_rank: int) -> None:
        super().__init__(message)
        self.launcher_rank = launcher_rank


def _refuse_if_alone(size: int, library: str) -> None:
    """Raise :class:`LaunchError` where the launcher started several processes but this
    one's world has size 1 (:func:`hpc.env.world_mismatch` holds the rule)."""
    from hpc.env import detect, world_mismatch

    problem = world_mismatch(size, library)
    if problem is not None:
        raise LaunchError(problem, detect(hostname="").rank)


def world() -> Communicator:
    """The communicator of every rank in the job (created once per process).

    Collective the first time it is called (it duplicates ``COMM_WORLD``). Returns a
    :class:`SingleCommunicator` when the process was not started by an MPI launcher or
    mpi4py is not installed; ``MPIDL_COMM=mpi`` forces MPI (a singleton MPI process),
    ``MPIDL_COMM=single`` forbids it. On several ranks it starts the watchdog when the
    job wants one (:mod:`mpidl.comm.watchdog`: every ``mpidl`` command, or
    ``MPIDL_TIMEOUT`` set).

    Raises:
        LaunchError: a launcher started N > 1 processes (``srun``, ``mpiexec``) but
            MPI gives this one a world of its own, or mpi4py is missing: N separate
            jobs. The message names the fix (the ``srun --mpi=`` plugin, the wheel).
    """
    global _world
    if _world is None:
        if _want_mpi():
            try:
                from mpi4py import MPI
            except ImportError as e:
                if os.environ.get("MPIDL_COMM", "auto").lower() == "mpi":
                    raise ImportError(
                        "MPIDL_COMM=mpi but mpi4py cannot be imported; install it with "
                        "`pip install mpidl[mpi]` (or mpi4py built against your site MPI)"
                    ) from e
                _refuse_if_alone(1, "")
                _world = SingleCommunicator()
            else:
                from mpidl.comm.mpi import MpiCommunicator

                from mpidl.comm import watchdog

                if MPI.COMM_WORLD.Get_size() == 1:
                    from hpc.env import library_name

                    _refuse_if_alone(1, library_name(MPI.Get_library_version()))
                _world = MpiCommunicator(MPI.COMM_WORLD)
                _say_how_nodes_were_found(_world)
                watchdog.start_for(_world)
        else:
            _world = SingleCommunicator()
    return _world


__all__ = [
    "world",
    "Communicator",
    "SingleCommunicator",
    "DistributedError",
    "LaunchError",
    "Request",
    "split_counts",
]
