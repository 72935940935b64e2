"""A stand-in for CuPy without a GPU: host memory dressed as device arrays.

mpidl recognises a device array by its type's module (:mod:`mpidl.backend`), so a
:class:`FakeDeviceArray` (module ``cupy._core.core``) takes mpidl's device paths: the
communicator's direct-or-staged decision (:mod:`mpidl.comm.device`), the stager's
pinned copies, streams and events. Its memory is host memory, offered to MPI through
``__cuda_array_interface__``: mpi4py accepts that, and an MPI without CUDA support reads
it as the host memory it is, so the direct path runs too. It computes nothing (no
arithmetic); it has what the communicator and the stager use. What a real GPU would do
is recorded in :attr:`FakeCupy.log`, for tests to read::

    from mpidl.testing.fakedevice import fake_cupy

    with fake_cupy() as cp:
        x = cp.asarray(numpy.arange(4.0))
        comm.allreduce_(x)
        assert ("to_host", 32) in cp.copies()   # staged, not handed to MPI

Events complete at once, unless :attr:`FakeCupy.hold_events` is set: events recorded
then stay pending until :meth:`FakeCupy.release_events` (copies themselves are done at
once), which shows whether code waits for an event or only asks it.
"""
from __future__ import annotations

import contextlib
import ctypes
import types
from typing import Any, Iterator

import numpy


class FakeEvent:
    _fake: "FakeCupy"  # set on each FakeCupy's own subclass (its cuda.Event)

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self._done = True
        self.time = 0.0

    def record(self, stream: Any = None) -> None:
        self._done = not self._fake.hold_events
        if not self._done:
            self._fake._held.append(self)
        self.time = self._fake.clock
        self._fake.log.append(("record", getattr(stream, "name", "current")))

    @property
    def done(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        self._fake.log.append(("event_sync",))
        self._done = True


class FakeStream:
    _fake: "FakeCupy"  # set on each FakeCupy's own subclass (its cuda.Stream)

    def __init__(self, null: bool = False, non_blocking: bool = False,
                 name: str = "side") -> None:
        self.name = name

    def synchronize(self) -> None:
        self._fake.log.append(("sync", self.name))

    def wait_event(self, event: FakeEvent) -> None:
        self._fake.log.append(("wait_event", self.name))


class FakePointer:
    """The ``.data`` of a device array: a pointer with CuPy's asynchronous copies."""

    def __init__(self, owner: "FakeDeviceArray") -> None:
        self._owner = owner
        self.ptr = owner._a.ctypes.data

    def _address(self, mem: Any) -> int:
        return mem.value if isinstance(mem, ctypes.c_void_p) else int(mem)

    def copy_to_host_async(self, mem: Any, size: int, stream: Any = None) -> None:
        ctypes.memmove(self._address(mem), self.ptr, size)
        self._owner._fake.log.append(("to_host", size, getattr(stream, "name", "current")))

    def copy_from_host_async(self, mem: Any, size: int, stream: Any = None) -> None:
        ctypes.memmove(self.ptr, self._address(mem), size)
        self._owner._fake.log.append(("to_device", size, getattr(stream, "name", "current")))


class FakeDeviceArray:
    """A NumPy array that mpidl takes for a CuPy array (see the module docstring)."""

    def __init__(self, fake: "FakeCupy", a: numpy.ndarray) -> None:
        self._fake = fake
        self._a = a

    # -- what an array is ---------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)

    @property
    def data(self) -> FakePointer:
        return FakePointer(self)

    @property
    def __cuda_array_interface__(self) -> dict:
        self._fake.log.append(("cai", self.nbytes))
        contiguous = self._a.flags.c_contiguous
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self._a.ctypes.data, False),
                "strides": None if contiguous else self.strides}

    def __len__(self) -> int:
        return len(self._a)

    def __array__(self, dtype: Any = None, copy: Any = None) -> numpy.ndarray:
        # As CuPy: a device array never turns into a host one unasked (numpy.asarray,
        # pickling into a host buffer...): the host/device mix-ups a GPU run would hit.
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __repr__(self) -> str:
        return f"FakeDeviceArray({self._a!r})"

    def __reduce__(self) -> tuple:
        # Pickled (allgather_obj) and unpickled as a device array, as CuPy's are: on the
        # fake that is active where it is unpickled.
        return _unpickle, (self._a,)

    # -- views and copies -----------------------------------------------------------------
    def _wrap(self, a: Any) -> Any:
        return FakeDeviceArray(self._fake, a) if isinstance(a, numpy.ndarray) else a

    def __getitem__(self, key: Any) -> Any:
        return self._wrap(self._a[_host(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[_host(key)] = _host(value)

    def reshape(self, *shape: Any) -> "FakeDeviceArray":
        return self._wrap(self._a.reshape(*shape))

    def view(self, dtype: Any) -> "FakeDeviceArray":
        return self._wrap(self._a.view(dtype))

    def copy(self) -> "FakeDeviceArray":
        return self._wrap(self._a.copy())

    def astype(self, dtype: Any, copy: bool = True) -> "FakeDeviceArray":
        return self._wrap(self._a.astype(dtype, copy=copy))

    def fill(self, value: Any) -> None:
        self._a.fill(value)

    def get(self, stream: Any = None, order: str = "C", out: Any = None,
            blocking: bool = True) -> numpy.ndarray:
        """A host copy (what ``cupy.ndarray.get`` returns); not logged as staging."""
        if out is None:
            return self._a.copy()
        out[...] = self._a
        return out

    def set(self, arr: Any, stream: Any = None) -> None:
        self._a[...] = arr


def _unpickle(a: numpy.ndarray) -> FakeDeviceArray:
    from mpidl import backend

    fake = backend.cupy_module()
    if not isinstance(fake, FakeCupy):
        raise TypeError("a FakeDeviceArray unpickled outside fake_cupy()")
    return fake._wrap(a)


def _host(value: Any) -> Any:
    if isinstance(value, FakeDeviceArray):
        return value._a
    if isinstance(value, tuple):
        return tuple(_host(v) for v in value)
    return value


def _device(value: Any) -> numpy.ndarray:
    """The memory of a device array; a host array here is a mix-up (CuPy raises too)."""
    if not isinstance(value, FakeDeviceArray):
        raise TypeError(f"Unsupported type {type(value)}: a host array where CuPy takes "
                        "device arrays only")
    return value._a


class FakeCupy(types.ModuleType):
    """The fake ``cupy`` module: array constructors, ``cuda`` streams/events/pinned memory.

    Attributes:
        log: what a GPU would have done, in order: ``("cai", nbytes)`` MPI read a device
            pointer; ``("to_host"|"to_device", nbytes, stream)`` a copy was queued;
            ``("sync", stream)`` the host waited for a stream, ``("event_sync",)`` for
            an event; ``("record", stream)``, ``("wait_event", stream)``.
        hold_events: events recorded while True stay pending (see the module docstring).
        clock: the time (ms) an event records (for event-based timers).
    """

    ndarray = FakeDeviceArray

    def __init__(self) -> None:
        super().__init__("cupy")
        self.log: list[tuple] = []
        self.hold_events = False
        self.clock = 0.0
        self._held: list[FakeEvent] = []
        for name in ("float16", "float32", "float64", "int32", "int64", "uint8", "uint16",
                     "uint32", "intp", "bool_"):
            setattr(self, name, getattr(numpy, name))
        # Classes of this fake's own, as cupy.cuda.Event/Stream are classes (so that
        # hpc.gpu_check.SyncCounter can wrap their synchronize).
        event = type("Event", (FakeEvent,), {"_fake": self})
        stream = type("Stream", (FakeStream,), {"_fake": self})
        current = stream(name="current")
        self.cuda = types.SimpleNamespace(
            Event=event,
            Stream=stream,
            get_current_stream=lambda: current,
            alloc_pinned_memory=lambda n: bytearray(n),
            get_elapsed_time=lambda start, end: end.time - start.time,
        )

    # -- arrays -------------------------------------------------------------------------
    def _wrap(self, a: numpy.ndarray) -> FakeDeviceArray:
        return FakeDeviceArray(self, a)

    def asarray(self, a: Any, dtype: Any = None) -> FakeDeviceArray:
        if isinstance(a, FakeDeviceArray) and (dtype is None or a.dtype == dtype):
            return a
        return self._wrap(numpy.array(_host(a), dtype=dtype))

    def ascontiguousarray(self, a: Any, dtype: Any = None) -> FakeDeviceArray:
        host = numpy.ascontiguousarray(_host(a), dtype=dtype)
        if isinstance(a, FakeDeviceArray) and host is a._a:
            return a
        return self._wrap(host)

    def empty(self, shape: Any, dtype: Any = float) -> FakeDeviceArray:
        return self._wrap(numpy.empty(shape, dtype))

    def zeros(self, shape: Any, dtype: Any = float) -> FakeDeviceArray:
        return self._wrap(numpy.zeros(shape, dtype))

    def full(self, shape: Any, value: Any, dtype: Any = None) -> FakeDeviceArray:
        return self._wrap(numpy.full(shape, value, dtype))

    def arange(self, *args: Any, **kwargs: Any) -> FakeDeviceArray:
        return self._wrap(numpy.arange(*args, **kwargs))

    def stack(self, arrays: Any, axis: int = 0) -> FakeDeviceArray:
        return self._wrap(numpy.stack([_device(a) for a in arrays], axis=axis))

    def concatenate(self, arrays: Any, axis: int = 0) -> FakeDeviceArray:
        return self._wrap(numpy.concatenate([_device(a) for a in arrays], axis=axis))

    def empty_like(self, a: Any) -> FakeDeviceArray:
        return self._wrap(numpy.empty_like(_host(a)))

    def zeros_like(self, a: Any) -> FakeDeviceArray:
        return self._wrap(numpy.zeros_like(_host(a)))

    # -- what tests read ----------------------------------------------------------------
    def release_events(self) -> None:
        """Complete every event recorded while :attr:`hold_events` was set."""
        for event in self._held:
            event._done = True
        self._held.clear()

    def copies(self) -> list[tuple]:
        """The queued copies, without the stream: ``("to_host", nbytes)``..."""
        return [entry[:2] for entry in self.log if entry[0] in ("to_host", "to_device")]

    def mpi_reads(self) -> int:
        """How often MPI was handed a device pointer."""
        return sum(1 for entry in self.log if entry[0] == "cai")

    def host_waits(self) -> int:
        """How often the host waited for a stream or an event."""
        return sum(1 for entry in self.log if entry[0] in ("sync", "event_sync"))


@contextlib.contextmanager
def fake_cupy() -> Iterator[FakeCupy]:
    """Make :func:`mpidl.backend.cupy_module` return a fresh :class:`FakeCupy` inside."""
    from mpidl import backend

    saved = backend._cupy, backend._cupy_checked
    fake = FakeCupy()
    backend._cupy, backend._cupy_checked = fake, True
    try:
        yield fake
    finally:
        backend._cupy, backend._cupy_checked = saved


__all__ = ["FakeCupy", "FakeDeviceArray", "fake_cupy"]

# mpidl.backend takes an array for a CuPy one by its type's module.
FakeDeviceArray.__module__ = "cupy._core.core"
