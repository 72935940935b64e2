"""Array backends: NumPy on the CPU, CuPy on the GPU, the same code for both.

This is the only module of mpidl that imports cupy, and it does so lazily: importing
mpidl never initialises CUDA. Everything else finds its array module from its
arguments (``xp = get_array_module(x)``), as Chainer does.
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import numpy

from mpidl import names

_cupy: ModuleType | None = None
_cupy_checked = False


def cupy_module() -> ModuleType | None:
    """The cupy module if it can be imported, else None (never raises)."""
    global _cupy, _cupy_checked
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy  # noqa: F401  (optional: the [gpu] extra)

            _cupy = cupy
        except Exception:  # ImportError, or a CUDA driver error at import
            _cupy = None
    return _cupy


def _is_cupy_array(x: Any) -> bool:
    # Decide by the type's module so that a cupy array is recognised without importing
    # cupy for every numpy call.
    return type(x).__module__.split(".", 1)[0] == "cupy"


def _unwrap(x: Any) -> Any:
    # A Tensor's array is its .data; an array is itself (a CuPy array's own .data is
    # its MemoryPointer, never the array, so it must not be unwrapped).
    if isinstance(x, numpy.ndarray) or _is_cupy_array(x):
        return x
    return getattr(x, "data", x)


def get_array_module(*arrays: Any) -> ModuleType:
    """Return ``cupy`` if any argument is a CuPy array, else ``numpy``.

    Arguments may be arrays, mpidl Tensors (their ``.data`` is looked at), scalars or None.
    """
    for a in arrays:
        if _is_cupy_array(_unwrap(a)):
            return cupy_module()  # type: ignore[return-value]
    return numpy


def is_cupy(xp: ModuleType) -> bool:
    """True when ``xp`` is the cupy module."""
    return xp is not numpy and getattr(xp, "__name__", "") == "cupy"


def get_xp(name: str) -> ModuleType:
    """The array module named ``"numpy"``/``"cpu"`` or ``"cupy"``/``"gpu"``.

    Raises:
        RuntimeError: cupy was asked for but cannot be imported; names the extra to install.
    """
    name = name.lower()
    if name in ("numpy", "cpu", "np"):
        return numpy
    if name in ("cupy", "gpu", "cuda"):
        cp = cupy_module()
        if cp is None:
            raise RuntimeError(
                "the GPU backend needs CuPy, which cannot be imported here; "
                "install it with `pip install mpidl[gpu]` (cupy-cuda12x) on a machine with CUDA"
            )
        return cp
    raise ValueError(f"unknown array backend {name!r}; use 'numpy' or 'cupy'")


def as_numpy(x: Any) -> numpy.ndarray:
    """Return ``x`` as a NumPy array (copies device arrays to the host)."""
    x = _unwrap(x)
    if _is_cupy_array(x):
        return x.get()
    return numpy.asarray(x)


def to_device(x: Any, xp: ModuleType) -> Any:
    """Return ``x`` as an array of module ``xp`` (a no-op when it already is one)."""
    if xp is numpy:
        return as_numpy(x)
    return xp.asarray(x)


# -- half precision --------------------------------------------------------------------
# bfloat16 is not a NumPy type: ml_dtypes (Google's, what JAX and TensorFlow use)
# registers it as a NumPy dtype, and CuPy >= 14 accepts it ("minimal support"). Its
# arithmetic has gaps, measured here (NumPy 2.4, ml_dtypes 0.7): ``a @ b`` of two
# bfloat16 arrays returns float32, and a bfloat16 ``sum`` of 10,000 uniforms returns 256
# (every add rounds to 8 bits). So matrix products and sums of 16-bit floats are done
# in float32 at the boundary (:func:`matmul`, :func:`compute_dtype`) and rounded once.
# --precision (mpidl.names.PRECISIONS) -> the dtype of the parameters and activations.
PRECISIONS = dict(zip(names.PRECISIONS, ("float32", "float16", "bfloat16")))


def bfloat16() -> numpy.dtype:
    """The bfloat16 dtype (``ml_dtypes.bfloat16``); raises naming the package to install."""
    try:
        import ml_dtypes  # a dependency of mpidl (setup.cfg), imported when first asked
    except ImportError as e:  # pragma: no cover - installed with mpidl
        raise RuntimeError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes "
                           "(a dependency of mpidl)") from e
    return numpy.dtype(ml_dtypes.bfloat16)


def precision_dtype(precision: str) -> numpy.dtype:
    """The parameter dtype of ``precision``: "fp32", "fp16" or "bf16" (or a dtype name)."""
    name = PRECISIONS.get(precision, precision)
    if name == "bfloat16":
        return bfloat16()
    if name not in ("float16", "float32", "float64"):
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return numpy.dtype(name)


# The first CuPy with a bfloat16 dtype (experimental: cupy PR 9494; its cupyx kernels
# lack it, cupy issue 9630). mpidl refuses bf16 on an older CuPy rather than keeping
# bfloat16 bit patterns in uint16 arrays: every op of the engine (GEMMs, embeddings,
# norms, losses, the optimizers' fp32 masters) would need a widening wrapper and its
# GEMMs would run in fp32, the very cost #48 point 2 removes; fp16 runs on CuPy 13.
CUPY_BFLOAT16 = 14


def precision_problem(backend_name: str, precision: str) -> str | None:
    """Why ``precision`` cannot run on backend ``backend_name`` here (None: it can).

    bf16 on CuPy: needs CuPy 14 or later (an older CuPy has no bfloat16 dtype). Checked
    before any work (``mpidl train`` exits 2). Where CuPy does not import, get_xp says so.
    """
    if precision != "bf16" or backend_name.lower() not in ("cupy", "gpu", "cuda"):
        return None
    cp = cupy_module()
    if cp is None:
        return None
    version = str(getattr(cp, "__version__", "0"))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major >= CUPY_BFLOAT16:
        return None
    return (f"--precision=bf16 with --backend=cupy needs CuPy {CUPY_BFLOAT16} or later "
            f"(the first with a bfloat16 dtype); this CuPy is {version}. Use "
            f"--precision=fp16 (loss-scaled, runs on CuPy {version}), or install "
            f"cupy-cuda12x>={CUPY_BFLOAT16} (pip install 'mpidl[gpu]' then upgrade cupy)")


def dtype_name(dtype: Any) -> str:
    """A name :func:`named_dtype` reads back: NumPy's ``dtype.str`` (byte order
    included), or "bfloat16", whose ``str`` is an anonymous '<V2'."""
    dtype = numpy.dtype(dtype)
    return dtype.name if dtype.name == "bfloat16" else dtype.str


def named_dtype(name: str) -> numpy.dtype:
    """The dtype of a :func:`dtype_name` (bfloat16 imports ml_dtypes first)."""
    return bfloat16() if name == "bfloat16" else numpy.dtype(name)


def is_half(dtype: Any) -> bool:
    """Whether ``dtype`` is a 16-bit float: float16 or bfloat16."""
    dtype = numpy.dtype(dtype)
    return dtype.itemsize == 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


def compute_dtype(dtype: Any) -> numpy.dtype:
    """The dtype arithmetic on ``dtype`` accumulates in: float32 for a 16-bit float (the
    products and sums of mixed precision, Micikevicius et al. 2018), else ``dtype``."""
    return numpy.dtype(numpy.float32) if is_half(dtype) else numpy.dtype(dtype)


def matmul(a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` in ``a``'s dtype, 16-bit floats summed in float32.

    On the GPU (CuPy), 16-bit operands go to cuBLAS as they are (a float32 one beside
    them is narrowed to their dtype first; the result has ``a``'s dtype): CuPy
    multiplies float16 on the tensor cores with float32 accumulation (cublasGemmEx,
    compute type 32F: what mixed precision asks, Micikevicius et al. 2018) and rounds
    the product once. Widening them first ran the GEMM in FP32 (or TF32 where the job
    chose it, :func:`use_tf32`) plus two casts (#48). Into a float32 ``out`` (a gradient
    bucket) the 16-bit product is widened.

    On the host, NumPy has no half BLAS (a float16 256x256 product took 0.28 s against
    0.04 s in float32 here) and returns float32 for bfloat16, so half operands are
    widened, multiplied in float32 and the product rounded once, into ``out`` (which may
    be float32) or a new array of ``a``'s dtype.
    """
    xp = get_array_module(a, b)
    if not (is_half(a.dtype) or is_half(b.dtype)):
        return xp.matmul(a, b, out=out)
    if is_cupy(xp):
        a_dtype = a.dtype
        half = a.dtype if is_half(a.dtype) else b.dtype
        # One float32 operand (the input data of a half model): narrowed, as autocast
        # does, so that the GEMM still runs on the tensor cores.
        a, b = a.astype(half, copy=False), b.astype(half, copy=False)
        y = xp.matmul(a, b, out=out if out is not None and out.dtype == half else None)
        if out is None:
            return y.astype(a_dtype, copy=False)
        if y is not out:
            out[...] = y
        return out
    wide = compute_dtype(a.dtype)
    if out is not None and out.dtype == wide:
        return xp.matmul(a.astype(wide), b.astype(wide), out=out)
    y = xp.matmul(a.astype(wide), b.astype(wide))
    if out is None:
        return y.astype(a.dtype)
    out[...] = y
    return out


def gemm_dtype(xp: ModuleType, dtype: Any) -> str:
    """The dtype the engine's GEMMs of ``dtype`` operands run in on ``xp`` (what the
    planner prices, :mod:`mpidl.plan_layouts`): "float16"/"bfloat16" on CuPy (tensor
    cores, :func:`matmul`), "float32" for 16-bit floats on NumPy, else ``dtype``."""
    dtype = numpy.dtype(dtype)
    if is_half(dtype):
        return dtype.name if is_cupy(xp) else "float32"
    return dtype.name


# CuPy's compute types (cupy/_core/_routines_linalg.pxd): DEFAULT is full FP32 for
# float32 operands, TF32 lets cuBLAS round their inputs to TF32 on the tensor cores.
_COMPUTE_TYPE_DEFAULT, _COMPUTE_TYPE_TF32 = 1, 7


def use_tf32(xp: ModuleType, on: bool) -> None:
    """Make float32 GEMMs on ``xp`` run in TF32 (``on``) or full FP32: the job's choice
    (``mpidl train --tf32``), not CuPy's default nor a ``CUPY_TF32`` left in the
    environment. A no-op on NumPy."""
    if not is_cupy(xp):
        return
    os.environ["CUPY_TF32"] = "1" if on else "0"  # read by CuPy at its first GEMM
    try:
        from cupy._core import _routines_linalg  # set again if CuPy decided already
    except ImportError:
        return
    _routines_linalg.set_compute_type(numpy.float32,
                                      _COMPUTE_TYPE_TF32 if on else _COMPUTE_TYPE_DEFAULT)


def zeros_add_at(xp: ModuleType, shape: tuple, index: Any, values: Any) -> Any:
    """Zeros of ``shape`` (``values``' dtype) with ``values`` added at ``index``.

    As ``numpy.add.at``: repeated indices add up. CuPy's ``add.at`` (atomic adds) has no
    float16 kernel on every GPU and CUDA version, and many float16 adds into one element
    lose the sum anyway, so 16-bit floats accumulate in float32 and are rounded once.
    """
    dtype = values.dtype
    acc = compute_dtype(dtype)
    out = xp.zeros(shape, dtype=acc)
    xp.add.at(out, index, values.astype(acc, copy=False))
    return out.astype(dtype, copy=False)


_device_generators: dict[int, Any] = {}  # CuPy device id -> its Philox RandomState


def uniform_from_seed(xp: ModuleType, seed: int, shape: tuple[int, ...]) -> Any:
    """float32 uniforms in [0, 1) of ``shape``, drawn on ``xp``'s device from ``seed`` alone.

    The same ``(seed, shape)`` gives the same numbers on every call (per backend: NumPy
    and CuPy draw different ones). NumPy: ``numpy.random.default_rng(seed)``. CuPy: a
    cuRAND Philox generator of the current device, reseeded for the call (reseeding
    resets its offset; no state to allocate or checkpoint), so nothing is copied from
    the host. Callers derive ``seed`` from a checkpointed host generator
    (:mod:`mpidl.functions.dropout`), which makes device randomness resumable.
    """
    if not is_cupy(xp):
        return numpy.random.default_rng(seed).random(shape, dtype=numpy.float32)
    device = int(xp.cuda.runtime.getDevice())
    gen = _device_generators.get(device)
    if gen is None:
        from cupy.cuda import curand  # a submodule cupy may load lazily

        gen = _device_generators[device] = xp.random.RandomState(
            0, method=curand.CURAND_RNG_PSEUDO_PHILOX4_32_10)
    gen.seed(numpy.uint64(seed))  # CuPy casts the seed to uint64 with casting="safe"
    return gen.random_sample(shape, dtype=numpy.float32)


class DeviceClock:
    """Marks on the current CUDA stream (events), read once the GPU has passed them.

    Taking a mark never blocks the host. :meth:`seconds` between two marks is the GPU's
    time between reaching them; it waits only if the later mark is not reached yet
    (read it a step later and it has been). ``xp`` is cupy (or a stand-in with its
    ``cuda`` API, as in tests).
    """

    def __init__(self, xp: ModuleType) -> None:
        self._cuda = xp.cuda

    def mark(self) -> Any:
        event = self._cuda.Event()
        event.record(self._cuda.get_current_stream())
        return event

    @staticmethod
    def reached(mark: Any) -> bool:
        return bool(mark.done)

    def seconds(self, start: Any, end: Any) -> float:
        if not end.done:
            end.synchronize()
        return float(self._cuda.get_elapsed_time(start, end)) / 1e3


def device_clock(xp: ModuleType) -> DeviceClock | None:
    """A :class:`DeviceClock` for CuPy, None for NumPy (host clocks are exact there)."""
    return DeviceClock(xp) if is_cupy(xp) else None


def synchronize(x: Any = None) -> None:
    """Wait until the work queued on the current CUDA stream is done.

    A no-op for NumPy arrays (and when ``x`` is None and CuPy was never used). MPI reads
    device buffers directly, so a CuPy array must be synchronised before it is handed to
    MPI: the kernel that produced it may still be running on the stream.
    """
    if x is not None:
        if not _is_cupy_array(_unwrap(x)):
            return
    elif not _cupy_checked or _cupy is None:
        return
    cp = cupy_module()
    if cp is not None:
        cp.cuda.get_current_stream().synchronize()


def select_device(local_rank: int | None = None) -> int | None:
    """Make this rank's GPU the current CuPy device; call before the first CUDA allocation.

    The choice is :func:`hpc.gpu.bind`'s: by node-local rank (read from the launcher when
    ``local_rank`` is None), among the devices in ``CUDA_VISIBLE_DEVICES`` (Slurm's
    ``--gpus-per-task`` leaves each task one visible device, which is then device 0).
    Returns the device index, or None without CuPy or GPUs.
    """
    from hpc.gpu import bind

    return bind(local_rank)


THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def limit_cpu_threads(ranks_on_node: int) -> int | None:
    """Share this node's cores among its ranks: BLAS threads = cores // ranks_on_node.

    Several ranks per node each running a BLAS thread pool as wide as the node
    oversubscribe the cores, and MPI ranks that wait by spinning then lose their time
    slices: on 2 cores, 2 ranks x 2 threads ran the default job 10-40x slower than
    2 ranks x 1 thread. Nothing is changed when the user set ``OMP_NUM_THREADS`` (or the
    OpenBLAS/MKL variable) or when threadpoolctl is missing. Returns the thread count set.
    """
    if any(os.environ.get(v) for v in THREAD_VARIABLES):
        return None
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    threads = max(1, cores // max(1, ranks_on_node))
    threadpool_limits(limits=threads, user_api="blas")
    return threads


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it.

    A training step allocates and frees the same large activations every step. By
    default glibc gives memory above a dynamic threshold back to the kernel (trim,
    munmap), so the next step page-faults it in again: measured on the reference
    transformer, 44 ms of a 240 ms step (13,900 faults). Raising the trim threshold and
    fixing the mmap threshold at its 32 MiB maximum (what the variables
    ``MALLOC_TRIM_THRESHOLD_``/``MALLOC_MMAP_THRESHOLD_`` do) keeps it: 17% faster steps
    in ``mpidl train reviews-transformer``; the process keeps its peak heap. Returns
    False where the C library is not glibc (nothing changed).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_trim_threshold, 2**31 - 1)) and \
        bool(mallopt(m_mmap_threshold, 32 * 2**20))


def default_xp() -> ModuleType:
    """The array module chosen by ``MPIDL_BACKEND`` (``numpy`` unless set to ``cupy``)."""
    return get_xp(os.environ.get("MPIDL_BACKEND", "numpy"))
