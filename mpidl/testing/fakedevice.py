"""A stand-in for CuPy without a GPU: host memory dressed as device arrays, that computes
and counts what a GPU would be asked to do.

mpidl recognises a device array by its type's module (:mod:`mpidl.backend`), so a
:class:`FakeDeviceArray` (module ``cupy._core.core``) takes mpidl's device paths: the
communicator's direct-or-staged decision (:mod:`mpidl.comm.device`), the stager's
pinned copies, streams and events, and every ``xp.*`` call of the engine. Its memory is
host memory, offered to MPI through ``__cuda_array_interface__``: mpi4py accepts that,
and an MPI without CUDA support reads it as the host memory it is, so the direct path
runs too.

It computes with NumPy: ufuncs, operators, ``matmul``, reductions, indexing and
``cupy.random`` return fake device arrays (a reduction a 0-d array, as CuPy's do). It
models what CuPy 13 refuses, so that a GPU run's first errors show up here:

- no implicit conversion to the host (``numpy.asarray``, pickling into a host buffer);
- no NumPy array mixed into device arithmetic (``cupy.add(d, h)``, ``d + h``);
- no bfloat16 dtype (CuPy added an experimental one in v14): ``FakeCupy(version="14.0.0")``
  models a CuPy that has it.

It counts, per phase of a training step (:data:`PHASES`) and per thread (a thread rank
of :func:`mpidl.testing.run_ranks` is a thread), :class:`PhaseCounts`: kernel launches,
host reads (``float``, ``int``, ``bool``, ``.item()``, ``.get()``...), stream and event
synchronisations, the operand dtypes of every GEMM and how many float32 GEMMs had an
operand just widened from 16 bits. The phase of a count is read from the call stack
(:func:`phase_of`): no instrumentation in the engine. What a GPU would have done is also
recorded in order in :attr:`FakeCupy.trace` (not ``log``: that is ``cupy.log``), for tests to read::

    from mpidl.testing.fakedevice import fake_cupy

    with fake_cupy() as cp:
        x = cp.asarray(numpy.arange(4.0))
        comm.allreduce_(x)
        assert ("to_host", 32) in cp.copies()   # staged, not handed to MPI

Events complete at once, unless :attr:`FakeCupy.hold_events` is set: events recorded
then stay pending until :meth:`FakeCupy.release_events` (copies themselves are done at
once), which shows whether code waits for an event or only asks it.

``python -m mpidl.testing.fakedevice --model NAME ...`` runs one training step on it
(:mod:`mpidl.testing.fake_step`) and prints the counts as one JSON line.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator

import numpy

PHASES = ("forward", "backward", "exchange", "optimizer", "checkpoint")
CUPY_STAND_IN = True  # hpc.gpu_check.SyncCounter names the caller of this module's frames

# Where a count is attributed, by the files on the call stack (phase_of). Paths are
# relative to the repository, with "/" separators.
_CHECKPOINT_FILES = ("mpidl/train/checkpoint", "mpidl/train/sharded.py",
                     "mpidl/train/consolidate.py", "mpidl/parallel/pipeline_state.py",
                     "mpidl/parallel/zero_state.py", "mpidl/parallel/tensor_state.py")
_EXCHANGE_FILES = ("mpidl/comm/", "mpidl/parallel/buckets.py",
                   "mpidl/parallel/compression.py", "mpidl/parallel/sparse.py",
                   "mpidl/parallel/transport.py", "mpidl/parallel/overlap.py",
                   "mpidl/parallel/zero_gather.py", "mpidl/parallel/pipeline_messages.py",
                   "mpidl/parallel/agreement.py")
_OPTIMIZER_FILES = ("mpidl/optim/",)
_HERE = os.path.abspath(__file__)


def phase_of(frame: Any) -> str:
    """The phase of a step that the code running at ``frame`` belongs to.

    A checkpoint's frames anywhere on the stack make it "checkpoint" (its gathers
    included). Otherwise the innermost frame that says decides: the communicators and
    the parallel wrappers' exchange code "exchange" (a bucket's allreduce started from a
    backward hook is exchange, not backward), ``mpidl/optim`` "optimizer" (the
    non-finite check, unscaling and clipping included), a function named ``*backward*``
    of mpidl "backward" (recomputation inside backward included). The rest is
    "forward".
    """
    found = None
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        where = path[path.rfind("/mpidl/") + 1:] if "/mpidl/" in path else ""
        if where:
            if where.startswith(_CHECKPOINT_FILES):
                return "checkpoint"
            if found is None:
                if where.startswith(_EXCHANGE_FILES):
                    found = "exchange"
                elif where.startswith(_OPTIMIZER_FILES):
                    found = "optimizer"
                elif "backward" in frame.f_code.co_name:
                    found = "backward"
        frame = frame.f_back
    return found or "forward"


def _caller() -> Any:
    """The first frame outside this module (and NumPy, which calls back into it)."""
    frame = sys._getframe(1)
    while frame is not None and (os.path.abspath(frame.f_code.co_filename) == _HERE or
                                 f"{os.sep}numpy{os.sep}" in frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def _site(frame: Any) -> str:
    if frame is None:
        return "?"
    parts = frame.f_code.co_filename.split(os.sep)
    return f"{'/'.join(parts[-2:])}:{frame.f_lineno} in {frame.f_code.co_name}"


@dataclasses.dataclass
class PhaseCounts:
    """What one phase asked of the device.

    Attributes:
        launches: kernels (an elementwise op, a reduction, a GEMM, a copy between
            dtypes, a fill...); views and host-to-device copies are none.
        host_reads: the host waited for a device value (``float``, ``int``, ``bool``,
            ``.item()``, ``.get()``, ``.tolist()``, ``cupy.asnumpy``).
        syncs: ``Stream``/``Event``/``Device.synchronize`` calls.
        gemm_dtypes: ``"float16,float16"`` (the operand dtypes) -> GEMMs.
        widened_gemms: float32 GEMMs with an operand cast from a 16-bit float just before
            (mixed precision that runs at fp32 speed, plus the casts).
        uploads: host arrays copied to the device (``cupy.asarray`` of host data).
        read_sites: ``"file:line in function"`` of each host read, in order.
        widened_sites: the same, of each widened GEMM.
    """

    launches: int = 0
    host_reads: int = 0
    syncs: int = 0
    gemm_dtypes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    widened_gemms: int = 0
    uploads: int = 0
    read_sites: list = dataclasses.field(default_factory=list)
    widened_sites: list = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return {"launches": self.launches, "host_reads": self.host_reads,
                "syncs": self.syncs, "gemm_dtypes": dict(self.gemm_dtypes),
                "widened_gemms": self.widened_gemms, "uploads": self.uploads,
                "read_sites": list(self.read_sites), "widened_sites": list(self.widened_sites)}


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
        self._fake.trace.append(("record", getattr(stream, "name", "current")))

    @property
    def done(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        self._fake.trace.append(("event_sync",))
        self._fake._tally().syncs += 1
        self._done = True


class FakeStream:
    _fake: "FakeCupy"  # set on each FakeCupy's own subclass (its cuda.Stream)

    def __init__(self, null: bool = False, non_blocking: bool = False,
                 name: str = "side") -> None:
        self.name = name

    def synchronize(self, _read: bool = False) -> None:
        if _read:  # a host read's own wait: counted as the read
            self._fake.trace.append(("read", self.name))
            return
        self._fake.trace.append(("sync", self.name))
        self._fake._tally().syncs += 1

    def wait_event(self, event: FakeEvent) -> None:
        self._fake.trace.append(("wait_event", self.name))

    def use(self) -> "FakeStream":
        return self

    def __enter__(self) -> "FakeStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class FakeDevice:
    _fake: "FakeCupy"

    def __init__(self, device: int = 0) -> None:
        self.id = int(device)

    def use(self) -> None:
        self._fake.device = self.id

    def synchronize(self) -> None:
        self._fake.trace.append(("sync", "device"))
        self._fake._tally().syncs += 1

    def __enter__(self) -> "FakeDevice":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class FakePointer:
    """The ``.data`` of a device array: a pointer with CuPy's asynchronous copies."""

    def __init__(self, owner: "FakeDeviceArray") -> None:
        self._owner = owner
        self.ptr = owner._a.ctypes.data

    def _address(self, mem: Any) -> int:
        return mem.value if isinstance(mem, ctypes.c_void_p) else int(mem)

    def copy_to_host_async(self, mem: Any, size: int, stream: Any = None) -> None:
        ctypes.memmove(self._address(mem), self.ptr, size)
        self._owner._fake.trace.append(("to_host", size, getattr(stream, "name", "current")))

    def copy_from_host_async(self, mem: Any, size: int, stream: Any = None) -> None:
        ctypes.memmove(self.ptr, self._address(mem), size)
        self._owner._fake.trace.append(("to_device", size, getattr(stream, "name", "current")))


# NumPy functions that make views or read metadata: no kernel on a GPU.
_NO_KERNEL = frozenset((
    "reshape", "ravel", "transpose", "swapaxes", "moveaxis", "expand_dims", "squeeze",
    "broadcast_to", "broadcast_arrays", "atleast_1d", "atleast_2d", "atleast_3d", "shape",
    "ndim", "size", "result_type", "promote_types", "can_cast", "iinfo", "finfo", "dtype",
    "isscalar", "issubdtype", "split", "array_split", "view", "T", "real", "imag",
    "empty", "empty_like", "broadcast_shapes", "rollaxis", "flip", "diagonal"))
_GEMMS = frozenset(("matmul", "dot", "tensordot", "einsum", "inner", "vdot"))


class FakeDeviceArray:
    """A NumPy array that mpidl takes for a CuPy array (see the module docstring)."""

    __array_priority__ = 100  # NumPy scalars defer to this type's operators

    def __init__(self, fake: "FakeCupy", a: numpy.ndarray) -> None:
        self._fake = fake
        self._a = a
        self._widened = False  # cast from a 16-bit float to float32 by astype

    # -- what an array is ---------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    device = property(lambda self: FakeDevice(self._fake.device))

    @property
    def data(self) -> FakePointer:
        return FakePointer(self)

    @property
    def __cuda_array_interface__(self) -> dict:
        self._fake.trace.append(("cai", self.nbytes))
        contiguous = self._a.flags.c_contiguous
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self._a.ctypes.data, False),
                "strides": None if contiguous else self.strides}

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self._a)):
            yield self[i]

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

    # -- host reads -----------------------------------------------------------------------
    def _read(self) -> numpy.ndarray:
        self._fake._read()
        return self._a

    def __float__(self) -> float:
        return float(self._read())

    def __int__(self) -> int:
        return int(self._read())

    def __index__(self) -> int:
        return self._read().__index__()

    def __bool__(self) -> bool:
        return bool(self._read())

    def __complex__(self) -> complex:
        return complex(self._read())

    def item(self) -> Any:
        return self._read().item()

    def tolist(self) -> Any:
        return self._read().tolist()

    def get(self, stream: Any = None, order: str = "C", out: Any = None,
            blocking: bool = True) -> numpy.ndarray:
        """A host copy (what ``cupy.ndarray.get`` returns); a host read, not staging."""
        a = self._read()
        if out is None:
            return a.copy()
        out[...] = a
        return out

    def set(self, arr: Any, stream: Any = None) -> None:
        self._a[...] = arr

    # -- views, copies and kernels ----------------------------------------------------------
    def _wrap(self, a: Any) -> Any:
        return self._fake._wrap_result(a)

    def __getitem__(self, key: Any) -> Any:
        key = _index(self._fake, key)
        out = self._a[key]
        if not _basic(key):  # gathers (integer or mask indices) are kernels
            self._fake._launch()
        return self._wrap(out)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._fake._launch()
        self._a[_index(self._fake, key, reading=False)] = _host(value)

    def reshape(self, *shape: Any, **kwargs: Any) -> "FakeDeviceArray":
        return self._wrap(self._a.reshape(*shape, **kwargs))

    def view(self, dtype: Any = None) -> "FakeDeviceArray":
        return self._wrap(self._a.view() if dtype is None else self._a.view(dtype))

    def copy(self, order: str = "C") -> "FakeDeviceArray":
        self._fake._launch()
        return self._wrap(self._a.copy(order))

    def astype(self, dtype: Any, copy: bool = True, **kwargs: Any) -> "FakeDeviceArray":
        dtype = numpy.dtype(dtype)
        if not copy and dtype == self._a.dtype:
            return self
        self._fake._launch()
        out = self._wrap(self._a.astype(dtype, **kwargs))
        out._widened = _is_half(self._a.dtype) and dtype == numpy.float32
        return out

    def fill(self, value: Any) -> None:
        self._fake._launch()
        self._a.fill(_host(value))

    def __getattr__(self, name: str) -> Any:
        # The rest of ndarray's methods and attributes (sum, max, T, ...), computed by
        # NumPy on the array's memory, results as device arrays.
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(self._a, name)
        if not callable(value):
            return self._wrap(value) if isinstance(value, numpy.ndarray) else value
        fake = self._fake

        def method(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = fake._device_args(name, args, kwargs)
            if name not in _NO_KERNEL:
                fake._launch()
            if name in _GEMMS:
                fake._gemm(self, args[0])
            out = kwargs.get("out")
            result = value(*_host(args), **_host(kwargs))
            return out if out is not None else fake._wrap_result(result)

        return method

    # -- NumPy's protocols: numpy.exp(d), numpy.sum(d) run here, as on CuPy -------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        fake = self._fake
        inputs, kwargs = fake._device_args(ufunc.__name__, inputs, kwargs)
        if ufunc.__name__ == "matmul":
            fake._gemm(*(i for i in inputs[:2]))
        fake._launch()
        out = kwargs.get("out")
        result = getattr(ufunc, method)(*_host(inputs), **_host(kwargs))
        if out is not None and method == "__call__":
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out
        return fake._wrap_result(result)

    def __array_function__(self, func: Any, types_: Any, args: Any, kwargs: Any) -> Any:
        return self._fake._call(func.__name__, func, args, kwargs)


def _operator(name: str, inplace: bool = False) -> Callable:
    ufunc = {"add": numpy.add, "sub": numpy.subtract, "mul": numpy.multiply,
             "truediv": numpy.true_divide, "floordiv": numpy.floor_divide,
             "mod": numpy.remainder, "pow": numpy.power, "matmul": numpy.matmul,
             "and": numpy.bitwise_and, "or": numpy.bitwise_or, "xor": numpy.bitwise_xor,
             "lshift": numpy.left_shift, "rshift": numpy.right_shift, "lt": numpy.less,
             "le": numpy.less_equal, "eq": numpy.equal, "ne": numpy.not_equal,
             "gt": numpy.greater, "ge": numpy.greater_equal}[name.lstrip("r")
                                                             if name.startswith("r") and
                                                             name not in ("rshift",)
                                                             else name]
    reflected = name.startswith("r") and name != "rshift"

    def op(self: FakeDeviceArray, other: Any) -> Any:
        if name in ("eq", "ne") and other is None:
            return name == "ne"
        if inplace:
            return self.__array_ufunc__(ufunc, "__call__", self, other, out=(self,))
        pair = (other, self) if reflected else (self, other)
        return self.__array_ufunc__(ufunc, "__call__", *pair)

    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and",
              "or", "xor", "lshift", "rshift"):
    setattr(FakeDeviceArray, f"__{_name}__", _operator(_name))
    setattr(FakeDeviceArray, f"__r{_name}__", _operator("r" + _name if _name != "rshift"
                                                        else "rshift"))
    setattr(FakeDeviceArray, f"__i{_name}__", _operator(_name, inplace=True))
FakeDeviceArray.__rrshift__ = lambda self, other: self.__array_ufunc__(  # type: ignore
    numpy.right_shift, "__call__", other, self)
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(FakeDeviceArray, f"__{_name}__", _operator(_name))
for _name, _ufunc in (("neg", numpy.negative), ("pos", numpy.positive),
                      ("abs", numpy.absolute), ("invert", numpy.invert)):
    setattr(FakeDeviceArray, f"__{_name}__",
            lambda self, _u=_ufunc: self.__array_ufunc__(_u, "__call__", self))
FakeDeviceArray.__hash__ = None  # type: ignore[assignment]  (arrays are unhashable)


def _is_half(dtype: Any) -> bool:
    dtype = numpy.dtype(dtype)
    return dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


def _basic(key: Any) -> bool:
    """Whether an index makes a view (ints, slices, None, Ellipsis) rather than a gather."""
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, slice, numpy.integer))
               for k in keys)


def _index(fake: "FakeCupy", key: Any, reading: bool = True) -> Any:
    """An index on the host: device index arrays give their memory; reading through a
    boolean device mask needs its count of True on the host first (CuPy synchronises
    there; writing through it does not)."""
    keys = key if isinstance(key, tuple) else (key,)
    if reading and any(isinstance(k, FakeDeviceArray) and k.dtype == bool for k in keys):
        fake._read("boolean mask index")
    return _host(key)


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
    if isinstance(value, list):
        return [_host(v) for v in value]
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    return value


def _has_host_array(value: Any) -> bool:
    if isinstance(value, numpy.ndarray):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_host_array(v) for v in value)
    return False


def _device(value: Any) -> numpy.ndarray:
    """The memory of a device array; a host array here is a mix-up (CuPy raises too)."""
    if not isinstance(value, FakeDeviceArray):
        raise TypeError(f"Unsupported type {type(value)}: a host array where CuPy takes "
                        "device arrays only")
    return value._a


class _Random:
    """``cupy.random``: RandomState (cuRAND on a GPU) drawing device arrays."""

    def __init__(self, fake: "FakeCupy") -> None:
        self._fake = fake
        outer = self

        class RandomState:
            def __init__(self, seed: Any = None, method: Any = None) -> None:
                self._rs = numpy.random.RandomState(None if seed is None
                                                    else int(seed) % 2**32)

            def seed(self, seed: Any = None) -> None:
                self._rs.seed(None if seed is None else int(seed) % 2**32)

            def random_sample(self, size: Any = None, dtype: Any = float) -> Any:
                outer._fake._launch()
                return outer._fake._wrap(numpy.asarray(
                    self._rs.random_sample(size)).astype(dtype))

            def __getattr__(self, name: str) -> Any:
                draw = getattr(self._rs, name)

                def drawn(*args: Any, **kwargs: Any) -> Any:
                    dtype = kwargs.pop("dtype", None)
                    outer._fake._launch()
                    out = numpy.asarray(draw(*args, **kwargs))
                    return outer._fake._wrap(out if dtype is None else out.astype(dtype))

                return drawn

        self.RandomState = RandomState
        self._default = RandomState(0)

    def seed(self, seed: Any = None) -> None:
        self._default.seed(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._default, name)


# Constructors take host data (a host-to-device copy, no kernel of the engine's).
_CONSTRUCTORS = frozenset(("asarray", "array", "ascontiguousarray", "asanyarray"))


class FakeCupy(types.ModuleType):
    """The fake ``cupy`` module: NumPy's functions on device arrays, ``cuda`` streams,
    events, devices and pinned memory, ``random``.

    Args:
        version: the CuPy version modelled; below 14 there is no bfloat16.

    Attributes:
        trace: what a GPU would have done, in order: ``("cai", nbytes)`` MPI read a device
            pointer; ``("to_host"|"to_device", nbytes, stream)`` a copy was queued;
            ``("sync", stream)`` the host waited for a stream, ``("event_sync",)`` for
            an event; ``("record", stream)``, ``("wait_event", stream)``;
            ``("read", stream)`` a host read waited for the stream (CuPy's ``get``);
            ``("pinned", nbytes)`` pinned host memory was allocated; ``("h2d", nbytes)``
            ``cupy.asarray`` copied host data over.
        hold_events: events recorded while True stay pending (see the module docstring).
        clock: the time (ms) an event records (for event-based timers).
        has_bfloat16: whether the modelled CuPy has a bfloat16 dtype.
    """

    ndarray = FakeDeviceArray

    def __init__(self, version: str = "13.6.0") -> None:
        super().__init__("cupy")
        self.__version__ = version
        self.has_bfloat16 = int(version.split(".")[0]) >= 14
        self.trace: list[tuple] = []
        self.hold_events = False
        self.clock = 0.0
        self.device = 0
        self._held: list[FakeEvent] = []
        self._tallies: dict[int, dict[str, PhaseCounts]] = {}
        self._lock = threading.Lock()
        for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                     "uint8", "uint16", "uint32", "uint64", "intp", "bool_", "complex64",
                     "complex128", "newaxis", "inf", "nan", "pi", "e", "dtype", "finfo",
                     "iinfo", "result_type", "promote_types", "can_cast", "issubdtype",
                     "integer", "floating", "number", "generic"):
            setattr(self, name, getattr(numpy, name))
        self.random = _Random(self)
        # Classes of this fake's own, as cupy.cuda.Event/Stream are classes (so that
        # hpc.gpu_check.SyncCounter can wrap their synchronize).
        event = type("Event", (FakeEvent,), {"_fake": self})
        stream = type("Stream", (FakeStream,), {"_fake": self})
        device = type("Device", (FakeDevice,), {"_fake": self})
        current = stream(name="current")
        stream.null = current
        runtime = types.SimpleNamespace(
            getDevice=lambda: self.device, getDeviceCount=lambda: 1,
            setDevice=lambda d: setattr(self, "device", int(d)),
            getDeviceProperties=lambda d: {"name": b"fake device", "totalGlobalMem": 2**34,
                                           "major": 9, "minor": 0},
            deviceGetPCIBusId=lambda d: "0000:00:00.0",
            memGetInfo=lambda: (2**33, 2**34))
        curand = types.ModuleType("cupy.cuda.curand")
        curand.CURAND_RNG_PSEUDO_PHILOX4_32_10 = 100  # type: ignore[attr-defined]
        self._core = types.ModuleType("cupy._core")
        self._syncdetect = types.ModuleType("cupy._core.syncdetect")
        self._syncdetect._declare_synchronize = lambda: None  # type: ignore[attr-defined]
        self.compute_types: dict[str, int] = {}  # dtype name -> CuPy compute type set
        linalg = types.ModuleType("cupy._core._routines_linalg")
        linalg.set_compute_type = (  # type: ignore[attr-defined]
            lambda dtype, kind: self.compute_types.__setitem__(numpy.dtype(dtype).name, kind))
        self._core.__dict__.update(syncdetect=self._syncdetect, _routines_linalg=linalg)
        self.cuda = types.ModuleType("cupy.cuda")
        self.cuda.__dict__.update(
            Event=event, Stream=stream, Device=device, runtime=runtime, curand=curand,
            get_current_stream=lambda: current,
            alloc_pinned_memory=lambda n: (self.trace.append(("pinned", n)), bytearray(n))[1],
            get_elapsed_time=lambda start, end: end.time - start.time,
        )

    # -- counting -------------------------------------------------------------------------
    def _tally(self, frame: Any = None) -> PhaseCounts:
        """This thread's counts of the phase the caller is in."""
        frame = _caller() if frame is None else frame
        phases = self._tallies.get(threading.get_ident())
        if phases is None:
            with self._lock:
                phases = self._tallies.setdefault(threading.get_ident(),
                                                  {p: PhaseCounts() for p in PHASES})
        return phases[phase_of(frame)]

    def _launch(self) -> None:
        self._tally().launches += 1

    def _read(self, what: str = "") -> None:
        frame = _caller()
        tally = self._tally(frame)
        tally.host_reads += 1
        tally.read_sites.append(_site(frame) + (f" ({what})" if what else ""))
        # As CuPy: a read declares its wait (cupy._core.syncdetect, which
        # hpc.gpu_check.SyncCounter wraps), then waits for the stream.
        self._syncdetect._declare_synchronize()
        self.cuda.get_current_stream().synchronize(_read=True)

    def _gemm(self, a: Any, b: Any) -> None:
        tally = self._tally()
        if min(getattr(x, "ndim", 0) for x in (a, b)) < 2:
            return  # a dot of vectors (a norm): a reduction, not a GEMM
        dtypes = [x.dtype.name for x in (a, b)]
        tally.gemm_dtypes[",".join(dtypes)] += 1
        if all(d == "float32" for d in dtypes) and any(
                getattr(x, "_widened", False) for x in (a, b)):
            tally.widened_gemms += 1
            tally.widened_sites.append(_site(_caller()))

    def counts(self, thread: int | None = None) -> dict[str, PhaseCounts]:
        """The counts of a thread (this one by default), per phase."""
        ident = threading.get_ident() if thread is None else thread
        return self._tallies.get(ident, {p: PhaseCounts() for p in PHASES})

    def reset_counts(self) -> None:
        """Forget this thread's counts (each thread rank resets its own)."""
        self._tallies.pop(threading.get_ident(), None)

    # -- arrays -------------------------------------------------------------------------
    def _wrap(self, a: numpy.ndarray) -> FakeDeviceArray:
        if not self.has_bfloat16 and a.dtype.name == "bfloat16":
            raise TypeError(f"Unsupported dtype bfloat16: CuPy {self.__version__} has no "
                            "bfloat16 (an experimental one came with CuPy 14)")
        return FakeDeviceArray(self, a)

    def _wrap_result(self, value: Any) -> Any:
        if isinstance(value, numpy.ndarray):
            return self._wrap(value)
        if isinstance(value, numpy.generic):  # CuPy's reductions give 0-d arrays
            return self._wrap(numpy.asarray(value))
        if isinstance(value, tuple):
            return tuple(self._wrap_result(v) for v in value)
        if isinstance(value, list):
            return [self._wrap_result(v) for v in value]
        return value

    def _device_args(self, name: str, args: Any, kwargs: dict) -> tuple:
        """The arguments of a device function, refusing host arrays as CuPy does."""
        if _has_host_array(args) or _has_host_array(list(kwargs.values())):
            kinds = [type(a).__name__ for a in args]
            raise TypeError(f"Unsupported type <class 'numpy.ndarray'>: cupy.{name} got "
                            f"a host array among its arguments ({', '.join(kinds)}); move "
                            "it to the device first (cupy.asarray)")
        return args, kwargs

    def _call(self, name: str, func: Callable, args: Any, kwargs: dict) -> Any:
        args, kwargs = self._device_args(name, args, kwargs)
        if "dtype" in kwargs and kwargs["dtype"] is not None and not self.has_bfloat16 \
                and numpy.dtype(kwargs["dtype"]).name == "bfloat16":
            self._wrap(numpy.empty(0, kwargs["dtype"]))  # raises as CuPy 13 does
        if name in _GEMMS and len(args) >= 2:
            self._gemm(args[0], args[1]) if name != "einsum" else self._gemm(*args[1:3])
        if name not in _NO_KERNEL:
            self._launch()
        out = kwargs.get("out")
        result = func(*_host(args), **_host(kwargs))
        if out is not None:
            return out
        return self._wrap_result(result)

    def __getattr__(self, name: str) -> Any:
        # Every other NumPy function, on device arrays (cupy.exp, cupy.add.at, ...).
        value = getattr(numpy, name)
        if isinstance(value, numpy.ufunc):
            return _FakeUfunc(self, value)
        if isinstance(value, type) or not callable(value):
            return value
        return lambda *args, **kwargs: self._call(name, value, args, kwargs)

    def asarray(self, a: Any, dtype: Any = None, order: Any = None) -> FakeDeviceArray:
        if isinstance(a, FakeDeviceArray):
            return a if dtype is None or a.dtype == dtype else a.astype(dtype)
        out = self._wrap(numpy.array(_host(a), dtype=dtype))
        self.trace.append(("h2d", out.nbytes))
        if isinstance(a, numpy.ndarray):
            self._tally().uploads += 1
        return out

    def array(self, a: Any, dtype: Any = None, copy: bool = True, **kwargs: Any) -> Any:
        if isinstance(a, FakeDeviceArray):
            return a.astype(dtype or a.dtype) if copy else self.asarray(a, dtype)
        return self.asarray(a, dtype)

    def ascontiguousarray(self, a: Any, dtype: Any = None) -> FakeDeviceArray:
        if not isinstance(a, FakeDeviceArray):
            return self.asarray(numpy.ascontiguousarray(a, dtype=dtype))
        host = numpy.ascontiguousarray(a._a, dtype=dtype)
        if host is a._a:
            return a
        self._launch()
        return self._wrap(host)

    def asnumpy(self, a: Any, stream: Any = None, out: Any = None) -> numpy.ndarray:
        if isinstance(a, FakeDeviceArray):
            return a.get(out=out)
        return numpy.asarray(a)

    def get_array_module(self, *args: Any) -> Any:
        return self if any(isinstance(a, FakeDeviceArray) for a in args) else numpy

    def empty(self, shape: Any, dtype: Any = float, order: str = "C") -> FakeDeviceArray:
        return self._wrap(numpy.empty(shape, dtype, order))

    def zeros(self, shape: Any, dtype: Any = float, order: str = "C") -> FakeDeviceArray:
        out = self._wrap(numpy.zeros(shape, dtype, order))
        self._launch()  # a memset
        return out

    def ones(self, shape: Any, dtype: Any = float) -> FakeDeviceArray:
        out = self._wrap(numpy.ones(shape, dtype))
        self._launch()
        return out

    def full(self, shape: Any, value: Any, dtype: Any = None) -> FakeDeviceArray:
        out = self._wrap(numpy.full(shape, _host(value), dtype))
        self._launch()
        return out

    def arange(self, *args: Any, **kwargs: Any) -> FakeDeviceArray:
        out = self._wrap(numpy.arange(*args, **kwargs))
        self._launch()
        return out

    def stack(self, arrays: Any, axis: int = 0) -> FakeDeviceArray:
        self._launch()
        return self._wrap(numpy.stack([_device(a) for a in arrays], axis=axis))

    def concatenate(self, arrays: Any, axis: int = 0, out: Any = None,
                    dtype: Any = None) -> FakeDeviceArray:
        self._launch()
        return self._wrap(numpy.concatenate([_device(a) for a in arrays], axis=axis,
                                            dtype=dtype))

    def empty_like(self, a: Any, dtype: Any = None) -> FakeDeviceArray:
        return self._wrap(numpy.empty_like(_device(a), dtype=dtype))

    def zeros_like(self, a: Any, dtype: Any = None) -> FakeDeviceArray:
        self._launch()
        return self._wrap(numpy.zeros_like(_device(a), dtype=dtype))

    def ones_like(self, a: Any, dtype: Any = None) -> FakeDeviceArray:
        self._launch()
        return self._wrap(numpy.ones_like(_device(a), dtype=dtype))

    # -- what tests read ----------------------------------------------------------------
    def release_events(self) -> None:
        """Complete every event recorded while :attr:`hold_events` was set."""
        for event in self._held:
            event._done = True
        self._held.clear()

    def copies(self) -> list[tuple]:
        """The queued copies, without the stream: ``("to_host", nbytes)``..."""
        return [entry[:2] for entry in self.trace if entry[0] in ("to_host", "to_device")]

    def mpi_reads(self) -> int:
        """How often MPI was handed a device pointer."""
        return sum(1 for entry in self.trace if entry[0] == "cai")

    def host_waits(self) -> int:
        """How often the host waited for a stream or an event."""
        return sum(1 for entry in self.trace if entry[0] in ("sync", "event_sync"))


class _FakeUfunc:
    """A NumPy ufunc as ``cupy.<name>``: ``__call__`` and ``at`` (``cupy.add.at``)."""

    def __init__(self, fake: FakeCupy, ufunc: Any) -> None:
        self._fake, self._ufunc = fake, ufunc
        self.__name__ = ufunc.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fake._call(self.__name__, self._ufunc, args, kwargs)

    def at(self, a: Any, indices: Any, b: Any = None) -> None:
        fake = self._fake
        fake._device_args(f"{self.__name__}.at", (a, b), {})
        fake._launch()
        self._ufunc.at(_device(a), _host(indices), *(() if b is None else (_host(b),)))

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        return self._fake._call(self.__name__, self._ufunc.reduce, args, kwargs)

    def accumulate(self, *args: Any, **kwargs: Any) -> Any:
        return self._fake._call(self.__name__, self._ufunc.accumulate, args, kwargs)


@contextlib.contextmanager
def fake_cupy(version: str = "13.6.0") -> Iterator[FakeCupy]:
    """Make :func:`mpidl.backend.cupy_module` return a fresh :class:`FakeCupy` inside,
    and ``import cupy`` (``cupy.cuda``, ``cupy.cuda.curand``, ``cupy._core.syncdetect``,
    ``cupy._core._routines_linalg``: its ``set_compute_type`` recorded in
    :attr:`FakeCupy.compute_types`) import it."""
    from mpidl import backend

    saved = backend._cupy, backend._cupy_checked
    fake = FakeCupy(version)
    names = ("cupy", "cupy.cuda", "cupy.cuda.curand", "cupy._core", "cupy._core.syncdetect",
             "cupy._core._routines_linalg")
    modules = {name: sys.modules.get(name) for name in names}
    backend._cupy, backend._cupy_checked = fake, True
    sys.modules.update(zip(names, (fake, fake.cuda, fake.cuda.curand, fake._core,
                                   fake._core.syncdetect, fake._core._routines_linalg)))
    try:
        yield fake
    finally:
        backend._cupy, backend._cupy_checked = saved
        backend._device_generators.clear()
        for name, module in modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


__all__ = ["FakeCupy", "FakeDeviceArray", "PhaseCounts", "PHASES", "fake_cupy", "phase_of"]

# mpidl.backend takes an array for a CuPy one by its type's module.
FakeDeviceArray.__module__ = "cupy._core.core"


if __name__ == "__main__":
    from mpidl.testing.fake_step import main

    sys.exit(main())
