"""Device buffers for MPI: straight through a CUDA-aware MPI, or staged through the host.

Which of the two a collective takes is :func:`mpidl.comm.device.device_path`'s decision
(per collective and per MPI library, from the probe's verdict); this module carries it
out. Direct: mpidl synchronises the CUDA stream that produced the array (MPI does not
know about streams, and the kernel writing the gradient may still be running) and hands
MPI the device pointer. Staged: the array is copied to a pinned host buffer (fast DMA,
reused between calls), MPI works on the copy, and the result is copied back.

The probe runs once per communicator, on the first collective that sees a CuPy array
(:func:`hpc.gpu.cuda_aware_mpi`: a child process tries device-buffer communication and
checks the numbers, so a non-aware MPI cannot crash the job). Rank 0 logs the choice.

Host synchronisation. A blocking collective must wait for its data anyway (MPI is driven
by the host), so its copy runs on the current stream and the host waits for it. A
non-blocking one (:meth:`Stager.stage_nonblocking`, the overlapped gradient buckets)
must not stall backward: its copy runs on a side stream after an event recorded on the
current stream, and the communicator starts the MPI operation once the copy's event has
completed, which it asks without blocking (``event.done``) whenever the caller tests a
request. Copies back to the device are queued on the current stream; a pinned buffer is
reused only after the copy that reads it (an event, waited for on the device where it
can be).
"""
from __future__ import annotations

import ctypes
import sys
from typing import Any, Callable

from mpidl.backend import cupy_module, synchronize
from mpidl.comm.device import DIRECT, device_path, library_family


class Stager:
    """Hands CuPy arrays to MPI for one communicator.

    Args:
        comm: the communicator the decision is agreed over (it must offer bcast_obj).
        cuda_aware: True/False to force the verdict, None to probe on first use.
        library: the MPI library family (:func:`mpidl.comm.device.library_family`);
            None reads it from mpi4py on first use.
    """

    def __init__(self, comm: Any, cuda_aware: bool | None, library: str | None = None) -> None:
        self._comm = comm
        self.cuda_aware = cuda_aware
        self.library = library
        # nbytes -> [(pinned uint8 array, event of the last copy reading it, or None)]
        self._free: dict[int, list[tuple[Any, Any]]] = {}
        self._side: Any = None  # the stream of non-blocking copies to the host

    def _decide(self) -> bool:
        if self.cuda_aware is None:
            from hpc.gpu import cuda_aware_mpi

            verdict = cuda_aware_mpi(comm=self._comm)
            self.cuda_aware = bool(verdict.aware)
            if self._comm.rank == 0:
                how = "device buffers go straight to MPI where mpidl.comm.device allows" \
                    if self.cuda_aware else "device buffers are staged through pinned host memory"
                print(f"mpidl: CUDA-aware MPI: {'yes' if self.cuda_aware else 'no'} "
                      f"({verdict.reason}); {how}", file=sys.stderr, flush=True)
        return self.cuda_aware

    def path(self, collective: str, op: Any = None) -> str:
        """``"direct"`` or ``"staged"`` for a device buffer in ``collective``.

        Collective on the first call (the probe's verdict is agreed over the
        communicator), local afterwards.
        """
        if self.library is None:
            from mpi4py import MPI

            self.library = library_family(MPI.Get_library_version())
        return device_path(collective, self.library, self._decide(), op)

    def _take(self, nbytes: int) -> tuple[Any, Any]:
        # Pinned buffers are pooled by size class, the power of two at or above the
        # request: several may be in flight at once (one per outstanding bucket of an
        # iallreduce, or send and receive of a sendrecv), and a pipeline's uneven
        # microbatches reuse one class instead of allocating per exact size (#48).
        size = 1 << max(nbytes - 1, 0).bit_length()
        free = self._free.setdefault(size, [])
        if free:
            return free.pop()
        import numpy

        mem = cupy_module().cuda.alloc_pinned_memory(size)
        return numpy.frombuffer(mem, dtype=numpy.uint8, count=size), None

    def _give_back(self, raw: Any, reading: Any) -> None:
        self._free[raw.size].append((raw, reading))

    def stage(self, x: Any, mode: str, collective: str,
              op: Any = None) -> tuple[Any, Callable[[], None]]:
        """Return ``(buffer, release)`` for a blocking collective: give ``buffer`` to
        MPI, call ``release()`` after.

        ``mode`` says how MPI uses the buffer: "in" (MPI reads it: send buffers), "out"
        (MPI writes it: receive buffers) or "inout" (in-place collectives). ``release``
        queues the copy of an "out"/"inout" result back into ``x`` on the current
        stream. Collective on the first call (see :meth:`path`), local afterwards.
        """
        if self.path(collective, op) == DIRECT:
            synchronize(x)
            return x, _nothing
        cp = cupy_module()
        stream = cp.cuda.get_current_stream()
        raw, reading = self._take(x.nbytes)
        host = raw[:x.nbytes].view(x.dtype).reshape(x.shape)
        if mode in ("in", "inout"):
            if reading is not None:
                stream.wait_event(reading)  # the buffer's last copy to a device first
            _to_host(x, host, stream)
            stream.synchronize()  # MPI reads the host copy now
        elif reading is not None:
            reading.synchronize()  # MPI writes into the buffer: its last reader must be done

        def release() -> None:
            done = None
            if mode in ("out", "inout"):
                done = _to_device(host, x, stream)
            self._give_back(raw, done)

        return host, release

    def stage_nonblocking(self, x: Any) -> "Staged":
        """Start copying ``x`` to pinned host memory without blocking the host.

        For an in-place non-blocking collective: the copy waits on the device for the
        work queued so far on the current stream (an event), so backward's later kernels
        are not held up; :class:`Staged` says when the host copy is complete.
        """
        cp = cupy_module()
        current = cp.cuda.get_current_stream()
        if self._side is None:
            self._side = cp.cuda.Stream(non_blocking=True)
        side = self._side
        raw, reading = self._take(x.nbytes)
        host = raw[:x.nbytes].view(x.dtype).reshape(x.shape)
        produced = cp.cuda.Event(disable_timing=True)
        produced.record(current)
        side.wait_event(produced)
        if reading is not None:
            side.wait_event(reading)
        _to_host(x, host, side)
        copied = cp.cuda.Event(disable_timing=True)
        copied.record(side)

        def release() -> None:
            self._give_back(raw, _to_device(host, x, cp.cuda.get_current_stream()))

        return Staged(host, copied, release)


class Staged:
    """A device array on its way to pinned host memory, for a non-blocking collective.

    Attributes:
        host: the pinned host buffer MPI works on, once :meth:`ready`.
    """

    def __init__(self, host: Any, copied: Any, release: Callable[[], None]) -> None:
        self.host = host
        self._copied = copied
        self.release = release  # queue the copy of the result back to the device

    def ready(self) -> bool:
        """Whether the copy to the host is complete (never blocks)."""
        return bool(self._copied.done)

    def wait(self) -> None:
        """Block until the copy to the host is complete."""
        if not self._copied.done:
            self._copied.synchronize()


def _to_host(x: Any, host: Any, stream: Any) -> None:
    """Queue the copy of C-contiguous device array ``x`` into pinned ``host`` on ``stream``."""
    assert x.flags.c_contiguous, "staged device buffers are C-contiguous"
    if x.nbytes:
        x.data.copy_to_host_async(ctypes.c_void_p(host.ctypes.data), x.nbytes, stream)


def _to_device(host: Any, x: Any, stream: Any) -> Any:
    """Queue the copy of pinned ``host`` into ``x`` on ``stream``; return its event."""
    if x.nbytes:
        x.data.copy_from_host_async(ctypes.c_void_p(host.ctypes.data), x.nbytes, stream)
    done = cupy_module().cuda.Event(disable_timing=True)
    done.record(stream)
    return done


def _nothing() -> None:
    pass
