"""Deterministic parameter initialisers.

Every initial value is drawn on the host from a ``numpy.random.Generator`` in float64 and
then cast, so two processes that build the same model from the same seed get
bit-identical parameters, whatever the dtype, the platform or the array backend
(data parallelism checks exactly that, and broadcasts from rank 0 anyway).

Module constructors take ``seed=`` or ``rng=``. With neither, they draw from this
module's default generator, seeded with 0 at import and reset by :func:`manual_seed`:
models built in the same order are then still identical in every process, yet two
layers of one model do not get the same values.

:func:`skipped` builds the parts of a model a process will not keep (another pipeline
stage's layers) without their memory: inside it the initialisers draw what they would
(so the layers built after it get the values of the whole build) and return a
read-only placeholder of the shape and dtype that holds one element.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Iterator

import numpy

_default_rng = numpy.random.default_rng(0)
# Per thread: thread ranks (mpidl.testing) build their stages at the same time.
_mode = threading.local()
# Values drawn at a time inside skipped(): 8 MiB of float64, whatever the layer's size.
CHUNK = 1 << 20


@contextlib.contextmanager
def skipped(draw: bool = True) -> Iterator[None]:
    """Inside, initialisers return placeholders (:func:`placeholder`) instead of arrays.

    ``draw``: still consume the generator's values, a chunk at a time, exactly as the
    real draw would (NumPy's uniform and normal draws are element by element, so
    chunks consume what one call does): what is built after the block gets the same
    values as in a whole build. False: draw nothing (a model's shapes only).
    Not collective; per thread.
    """
    before = getattr(_mode, "skip", None)
    _mode.skip = "draw" if draw else "shape"
    try:
        yield
    finally:
        _mode.skip = before


def placeholder(shape: tuple[int, ...], dtype: Any) -> numpy.ndarray:
    """A read-only array of ``shape`` and ``dtype`` holding one element (zero strides)."""
    return numpy.broadcast_to(numpy.zeros((), dtype=dtype), tuple(shape))


def is_placeholder(a: Any) -> bool:
    """Whether ``a`` is a :func:`placeholder` (built under :func:`skipped`)."""
    return isinstance(a, numpy.ndarray) and a.size > 1 and not any(a.strides) \
        and not a.flags.writeable


def _skip_draws(shape: tuple[int, ...], draw: Any, dtype: Any) -> numpy.ndarray | None:
    """Inside :func:`skipped`: ``draw(k)`` for the shape's elements, a chunk at a time,
    and the placeholder; else None."""
    mode = getattr(_mode, "skip", None)
    if mode is None:
        return None
    if mode == "draw":
        left = int(numpy.prod(shape, dtype=numpy.int64))
        while left:
            k = min(left, CHUNK)
            draw(k)
            left -= k
    return placeholder(shape, dtype)


def manual_seed(seed: int) -> None:
    """Reset the default generator used by constructors given neither seed nor rng."""
    global _default_rng
    _default_rng = numpy.random.default_rng(seed)


def make_rng(seed: int | None = None, rng: numpy.random.Generator | None = None
             ) -> numpy.random.Generator:
    """The generator a constructor draws from: ``rng``, else one from ``seed``, else the default.

    Raises:
        ValueError: both ``seed`` and ``rng`` were given.
    """
    if seed is not None and rng is not None:
        raise ValueError("pass seed= or rng=, not both")
    if rng is not None:
        return rng
    if seed is not None:
        return numpy.random.default_rng(seed)
    return _default_rng


def fan_in_out(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a weight; Linear weights are ``(out, in)`` as in PyTorch."""
    if len(shape) < 2:
        raise ValueError(f"fan in/out needs a weight of at least 2 dimensions, got shape {shape}")
    receptive = int(numpy.prod(shape[2:])) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


def uniform(shape: tuple[int, ...], bound: float, rng: numpy.random.Generator,
            dtype: Any = numpy.float32) -> numpy.ndarray:
    """Samples of U(-bound, bound)."""
    skip = _skip_draws(shape, lambda k: rng.uniform(-bound, bound, size=k), dtype)
    if skip is not None:
        return skip
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def normal(shape: tuple[int, ...], std: float, rng: numpy.random.Generator,
           dtype: Any = numpy.float32, mean: float = 0.0) -> numpy.ndarray:
    """Samples of N(mean, std²)."""
    skip = _skip_draws(shape, lambda k: rng.standard_normal(size=k), dtype)
    if skip is not None:
        return skip
    return (mean + std * rng.standard_normal(size=shape)).astype(dtype)


def xavier_uniform(shape: tuple[int, ...], rng: numpy.random.Generator,
                   dtype: Any = numpy.float32, gain: float = 1.0) -> numpy.ndarray:
    """Glorot & Bengio (2010): U(-a, a) with ``a = gain * sqrt(6 / (fan_in + fan_out))``."""
    fan_in, fan_out = fan_in_out(shape)
    return uniform(shape, gain * math.sqrt(6.0 / (fan_in + fan_out)), rng, dtype)


def kaiming_uniform(shape: tuple[int, ...], rng: numpy.random.Generator,
                    dtype: Any = numpy.float32, a: float = math.sqrt(5)) -> numpy.ndarray:
    """He et al. (2015), leaky-ReLU gain with slope ``a``, fan-in mode.

    The default ``a = sqrt(5)`` gives U(-1/sqrt(fan_in), 1/sqrt(fan_in)), PyTorch's
    default for Linear weights, so our layers start at the same scale as theirs.
    """
    fan_in, _ = fan_in_out(shape)
    gain = math.sqrt(2.0 / (1 + a * a))
    return uniform(shape, gain * math.sqrt(3.0 / fan_in), rng, dtype)


def zeros(shape: tuple[int, ...], dtype: Any = numpy.float32) -> numpy.ndarray:
    if getattr(_mode, "skip", None):  # nothing drawn
        return placeholder(shape, dtype)
    return numpy.zeros(shape, dtype=dtype)


def ones(shape: tuple[int, ...], dtype: Any = numpy.float32) -> numpy.ndarray:
    if getattr(_mode, "skip", None):
        return placeholder(shape, dtype)
    return numpy.ones(shape, dtype=dtype)
