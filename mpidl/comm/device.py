"""Which path a device (CuPy) buffer takes into each collective: the one table.

A CUDA-aware MPI can read and write device memory in *some* operations only. Handing it a
device pointer where it cannot does not fail cleanly: Open MPI's non-blocking reductions
reduce on the host through the device pointer and segfault (open-mpi/ompi#9845, #12045).
So the choice is made here, per collective and per MPI library, and nowhere else:

- ``"direct"``: the CuPy array goes to MPI itself, after its stream is synchronised.
- ``"staged"``: it is copied to pinned host memory, MPI works on the copy, and the
  result is copied back (:mod:`mpidl.comm.staged`).

When the probe (:func:`hpc.gpu.cuda_aware_mpi`) says MPI is not CUDA-aware, every
collective is staged. When it is aware:

=====================  ============  ==========  =========================================
collective             Open MPI      other MPI   why
=====================  ============  ==========  =========================================
``allreduce_``         direct        direct      Open MPI: ``coll/cuda`` wraps blocking
                                                 allreduce; elsewhere the probe ran it
``reduce_``            direct        staged      Open MPI: ``coll/cuda`` wraps reduce;
                                                 not probed elsewhere
``iallreduce_``        staged        staged      ``coll/cuda`` wraps no non-blocking
                                                 reduction: libnbc reduces on the host
                                                 through the device pointer (segfault,
                                                 ompi#9845, #12045); not probed elsewhere
``reduce_scatter``     direct        staged      equal blocks: ``Reduce_scatter_block``,
(equal blocks)                                   which ``coll/cuda`` wraps
``reduce_scatter``     staged        staged      uneven blocks: ``Reduce_scatter``, which
(uneven blocks)                                  Open MPI up to 5.0.x does not wrap
                                                 (``coll_reduce_scatter = NULL``; ompi
                                                 PR #13006 adds it on main only)
``bcast_``,            direct        direct      data movement only: the point-to-point
``allgather``,                                   transport (smcuda, UCX) handles device
``allgatherv``,                                  memory; the probe's sendrecv tested it
``alltoall``,
``sendrecv``
``isendrecv``,         direct        staged      non-blocking point-to-point: the same
``isend``, ``irecv_``
                                                 transport in Open MPI; not probed elsewhere
``iallgather``         staged        staged      non-blocking: libnbc's schedule copies
                                                 blocks with host memcpy; not probed
any reduction with a   staged        staged      MPI calls a user-defined op (the 16-bit
user-defined op                                  sums) on host memory
=====================  ============  ==========  =========================================

"Other MPI" is every library whose version string does not start with "Open MPI"
(MPICH, Cray MPICH, MVAPICH, Intel MPI): there only what the probe exercised goes direct.
"""
from __future__ import annotations

from typing import Any

DIRECT = "direct"
STAGED = "staged"

OPEN_MPI = "openmpi"
OTHER = "other"

# collective -> library family -> path, for a CUDA-aware MPI and a built-in op.
PATHS: dict[str, dict[str, str]] = {
    "allreduce_": {OPEN_MPI: DIRECT, OTHER: DIRECT},
    "reduce_": {OPEN_MPI: DIRECT, OTHER: STAGED},
    "iallreduce_": {OPEN_MPI: STAGED, OTHER: STAGED},
    "reduce_scatter_block": {OPEN_MPI: DIRECT, OTHER: STAGED},
    "reduce_scatter": {OPEN_MPI: STAGED, OTHER: STAGED},
    "bcast_": {OPEN_MPI: DIRECT, OTHER: DIRECT},
    "allgather": {OPEN_MPI: DIRECT, OTHER: DIRECT},
    "allgatherv": {OPEN_MPI: DIRECT, OTHER: DIRECT},
    "alltoall": {OPEN_MPI: DIRECT, OTHER: DIRECT},
    "sendrecv": {OPEN_MPI: DIRECT, OTHER: DIRECT},
    "isendrecv": {OPEN_MPI: DIRECT, OTHER: STAGED},
    "isend": {OPEN_MPI: DIRECT, OTHER: STAGED},
    "irecv_": {OPEN_MPI: DIRECT, OTHER: STAGED},
    "iallgather": {OPEN_MPI: STAGED, OTHER: STAGED},
}

REDUCTIONS = ("allreduce_", "reduce_", "iallreduce_", "reduce_scatter_block", "reduce_scatter")


def library_family(version: str) -> str:
    """``"openmpi"`` or ``"other"`` from ``MPI.Get_library_version()``."""
    return OPEN_MPI if version.lstrip().startswith("Open MPI") else OTHER


def device_path(collective: str, library: str, cuda_aware: bool, op: Any = None) -> str:
    """``"direct"`` or ``"staged"``: how a device buffer enters ``collective``.

    Args:
        collective: a key of :data:`PATHS` (``reduce_scatter_block`` for equal blocks).
        library: :func:`library_family` of the MPI in use.
        cuda_aware: the probe's verdict.
        op: the reduction op: a name ("sum"), an mpi4py ``MPI.Op``, or None for a
            collective without one. An op that is neither a name nor predefined
            (``MPI.Op.Create``) is user-defined, and MPI runs it on host memory.
    """
    per_library = PATHS[collective]  # KeyError for an unknown collective: a bug here
    if not cuda_aware:
        return STAGED
    if collective in REDUCTIONS and not _builtin(op):
        return STAGED
    return per_library[library if library in per_library else OTHER]


def _builtin(op: Any) -> bool:
    return op is None or isinstance(op, str) or bool(getattr(op, "is_predefined", False))


__all__ = ["DIRECT", "STAGED", "PATHS", "library_family", "device_path"]
