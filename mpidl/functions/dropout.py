"""Inverted dropout with explicit, seedable randomness.

The mask comes from the generator the caller passes, so a run is reproducible: give
each process (and each layer, if you like) its own ``numpy.random.Generator`` seeded from
the run's seed, and checkpoint its state. A host generator (``numpy.random.Generator`` or
``RandomState``) gives one 63-bit seed per call, and the mask is drawn from that seed on
the data's device (:func:`mpidl.backend.uniform_from_seed`): on CuPy no mask is copied
from the host, and the only state is the host generator's, which a checkpoint holds
(CuPy generator states cannot be saved), so a resumed run draws the same masks on both
backends. The host generator advances by one draw per call whatever the shape.

Other ``rng`` values: an int seed (the mask of that seed: the same on every call), a
``cupy.random.Generator``/``RandomState`` (drawn from directly; not checkpointable), or
None (the array module's global generator).

Masks drawn from a host generator changed with the per-call seed (NumPy masks before it
were the generator's own draws); the same seed still gives the same run.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, to_device, uniform_from_seed


def call_seed(rng: Any) -> int | None:
    """The seed of one call from a host generator (or an int seed); None for others."""
    if isinstance(rng, (int, numpy.integer)):
        return int(rng)
    if isinstance(rng, numpy.random.Generator):
        return int(rng.integers(2**63))
    if isinstance(rng, numpy.random.RandomState):
        return int(rng.randint(2**63, dtype=numpy.int64))
    return None


def _uniform(rng: Any, shape: tuple[int, ...], xp: Any) -> Any:
    seed = call_seed(rng)
    if seed is not None:
        return uniform_from_seed(xp, seed, shape)
    if rng is None:
        rng = xp.random  # the global generator of the array module
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
