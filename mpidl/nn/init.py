"""Deterministic parameter initialisers.

Every initial value is drawn on the host from a ``numpy.random.Generator`` in float64 and
then cast, so two processes that build the same model from the same seed get
bit-identical parameters, whatever the dtype, the platform or the array backend
(data parallelism checks exactly that, and broadcasts from rank 0 anyway).

Module constructors take ``seed=`` or ``rng=``. With neither, they draw from this
module's default generator, seeded with 0 at import and reset by :func:`manual_seed`:
models built in the same order are then still identical in every process, yet two
layers of one model do not get the same values.
"""
from __future__ import annotations

import math
from typing import Any

import numpy

_default_rng = numpy.random.default_rng(0)


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
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


def normal(shape: tuple[int, ...], std: float, rng: numpy.random.Generator,
           dtype: Any = numpy.float32, mean: float = 0.0) -> numpy.ndarray:
    """Samples of N(mean, std²)."""
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
    return numpy.zeros(shape, dtype=dtype)


def ones(shape: tuple[int, ...], dtype: Any = numpy.float32) -> numpy.ndarray:
    return numpy.ones(shape, dtype=dtype)
