"""Inverted dropout with explicit, seedable randomness.

The mask is drawn from the generator the caller passes, so a run is reproducible: give
each process (and each layer, if you like) its own ``numpy.random.Generator`` seeded from
the run's seed, and checkpoint its state. Accepted generators: ``numpy.random.Generator``,
``numpy.random.RandomState``, ``cupy.random.Generator`` / ``RandomState`` (for CuPy data,
a NumPy generator works too, at the price of a host-to-device copy), or an int seed (a
fresh ``numpy.random.default_rng(seed)``: the same mask on every call with that seed).
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, to_device


def _uniform(rng: Any, shape: tuple[int, ...], xp: Any) -> Any:
    if rng is None:
        rng = xp.random  # the global generator of the array module
    elif isinstance(rng, (int, numpy.integer)):
        rng = numpy.random.default_rng(int(rng))
    if hasattr(rng, "random") and not hasattr(rng, "random_sample"):
        u = rng.random(shape, dtype=numpy.float32)  # Generator
    else:
        try:  # cupy's RandomState takes a dtype; NumPy's does not
            u = rng.random_sample(shape, dtype=numpy.float32)
        except TypeError:
            u = rng.random_sample(shape)
    return to_device(u, xp) if get_array_module(u) is not xp else u


class Dropout(Function):
    def forward(self, x):
        xp = get_array_module(x)
        keep = _uniform(self.rng, x.shape, xp) >= self.p
        self.mask = keep.astype(x.dtype)
        self.mask *= x.dtype.type(1.0 / (1.0 - self.p))
        return x * self.mask

    def backward(self, gy):
        return gy * self.mask


def dropout(x: Any, p: float = 0.5, training: bool = True, rng: Any = None) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    Args:
        x: input tensor.
        p: drop probability in ``[0, 1)``.
        training: when False (evaluation) ``x`` is returned unchanged.
        rng: a NumPy/CuPy ``Generator`` or ``RandomState``, an int seed, or None for
            the array module's global generator (seeded by ``xp.random.seed``).
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p={p} must lie in [0, 1)")
    if not training or p == 0.0:
        return x if isinstance(x, Tensor) else Tensor(x)
    return Dropout.apply(x, p=p, rng=rng)
