"""Device buffers for MPI: straight through a CUDA-aware MPI, or staged through the host.

A CUDA-aware MPI reads and writes CuPy memory itself; mpidl then only synchronises the
CUDA stream that produced the array (MPI does not know about streams, and the kernel
writing the gradient may still be running). Without CUDA awareness, the array is copied
to a pinned host buffer (fast DMA, reused between calls), MPI works on the copy, and the
result is copied back.

Which of the two is decided once per communicator, on the first collective that sees a
CuPy array, by the functional probe of :func:`hpc.gpu.cuda_aware_mpi` (a child process
tries device-buffer communication and checks the numbers, so a non-aware MPI cannot
crash the job). Rank 0 logs the choice once.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from mpidl.backend import cupy_module, synchronize


class Stager:
    """Hands CuPy arrays to MPI for one communicator.

    Args:
        comm: the communicator the decision is agreed over (it must offer bcast_obj).
        cuda_aware: True/False to force the path, None to probe on first use.
    """

    def __init__(self, comm: Any, cuda_aware: bool | None) -> None:
        self._comm = comm
        self.cuda_aware = cuda_aware
        self._free: dict[int, list] = {}  # nbytes -> pinned buffers not in use

    def _decide(self) -> bool:
        if self.cuda_aware is None:
            from hpc.gpu import cuda_aware_mpi

            verdict = cuda_aware_mpi(comm=self._comm)
            self.cuda_aware = bool(verdict.aware)
            if self._comm.rank == 0:
                how = "device buffers go straight to MPI" if self.cuda_aware else \
                    "device buffers are staged through pinned host memory"
                print(f"mpidl: CUDA-aware MPI: {'yes' if self.cuda_aware else 'no'} "
                      f"({verdict.reason}); {how}", file=sys.stderr, flush=True)
        return self.cuda_aware

    def _take(self, nbytes: int) -> Any:
        # Pinned buffers are pooled by size: several may be in flight at once (one per
        # outstanding bucket of an iallreduce, or send and receive of a sendrecv).
        free = self._free.setdefault(nbytes, [])
        if free:
            return free.pop()
        import numpy

        mem = cupy_module().cuda.alloc_pinned_memory(max(nbytes, 1))
        return numpy.frombuffer(mem, dtype=numpy.uint8, count=nbytes)

    def stage(self, x: Any, mode: str = "inout") -> tuple[Any, Callable[[], None]]:
        """Return ``(buffer, release)``: give ``buffer`` to MPI, call ``release()`` after.

        ``mode`` says how MPI uses the buffer: "in" (MPI reads it: send buffers), "out"
        (MPI writes it: receive buffers) or "inout" (in-place collectives). ``release``
        copies an "out"/"inout" result back into ``x`` and returns the host buffer to
        the pool. Collective on the first call (the probe's verdict is agreed over the
        communicator), local afterwards.
        """
        if self._decide():
            synchronize(x)
            return x, _nothing
        raw = self._take(x.nbytes)
        host = raw.view(x.dtype).reshape(x.shape)
        if mode in ("in", "inout"):
            x.get(out=host)  # synchronous on the current stream, so x is complete

        def release() -> None:
            if mode in ("out", "inout"):
                x.set(host)
                # On a non-default stream set() copies asynchronously from this pinned
                # buffer; it must be done before the buffer is handed out again.
                synchronize(x)
            self._free[x.nbytes].append(raw)

        return host, release


def _nothing() -> None:
    pass
