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


def _warn_if_alone(comm: Communicator) -> None:
    """Say so when the launcher started several tasks but MPI sees a world of one.

    The classic cause is ``srun --mpi=pmi2`` with an MPI built for PMIx only (the Open
    MPI wheel): every task silently runs alone and the job still exits 0.
    """
    if comm.size != 1:
        return
    import sys

    from hpc.env import detect

    try:
        launched = detect().size
    except ValueError:
        return
    if launched > 1:
        print(f"mpidl: warning: the launcher started {launched} tasks, but MPI sees a world "
              "of size 1 in this one: the tasks are not one job. Under Slurm launch with "
              "`srun --mpi=pmix` (not pmi2); otherwise use the mpiexec of the MPI that "
              "mpi4py was built with.", file=sys.stderr, flush=True)


def world() -> Communicator:
    """The communicator of every rank in the job (created once per process).

    Collective the first time it is called (it duplicates ``COMM_WORLD``). Returns a
    :class:`SingleCommunicator` when the process was not started by an MPI launcher or
    mpi4py is not installed; ``MPIDL_COMM=mpi`` forces MPI (a singleton MPI process),
    ``MPIDL_COMM=single`` forbids it. On several ranks it starts the watchdog when the
    job wants one (:mod:`mpidl.comm.watchdog`: every ``mpidl`` command, or
    ``MPIDL_TIMEOUT`` set).
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
                _world = SingleCommunicator()
            else:
                from mpidl.comm.mpi import MpiCommunicator

                from mpidl.comm import watchdog

                _world = MpiCommunicator(MPI.COMM_WORLD)
                _warn_if_alone(_world)
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
    "Request",
    "split_counts",
]
