"""The unit of sharded data parallelism: parameters gathered, reduced and sharded together.

A :class:`Unit` is one flat buffer of member parameters, padded to a multiple of the
ranks; rank ``r`` owns block ``r``. :mod:`mpidl.parallel.zero` schedules the units'
gathers and reductions; this module only knows their layout.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.backend import get_array_module
from mpidl.nn.module import Module, Parameter


class Unit:
    """Parameters gathered, reduced and sharded together: one flat buffer.

    Attributes:
        index: position in the unit order (the same on every rank).
        params: the member parameters, in flat order.
        size: their elements in all; ``padded`` rounds it up to a multiple of the ranks.
        shard: this rank's block of the flat parameters, the optimizer's Parameter.
        module: the module whose forward gathers it (stage 3), else None.
        grad_dtype: the dtype of its full gradient: the parameters' own, or float32 for
            half parameters under mixed precision (the reduce-scatter then sums fp32).
    """

    def __init__(self, index: int, params: list[Parameter], ranks: int, rank: int,
                 module: Module | None = None) -> None:
        self.index, self.params, self.module = index, params, module
        self.size = sum(int(p.data.size) for p in params)
        self.block = -(-self.size // ranks) if self.size else 0
        self.padded = self.block * ranks
        self.start = rank * self.block  # this rank's block: [start, start + block)
        self.shapes = [tuple(p.data.shape) for p in params]
        first = params[0].data
        self.xp, self.dtype = get_array_module(first), first.dtype
        self.grad_dtype = first.dtype
        self.offsets = numpy.cumsum([0] + [int(p.data.size) for p in params]).tolist()
        self.flat_itemsize = first.itemsize
        self.flat: Any = None        # the full padded parameters, when held
        self.grad_flat: Any = None   # the full padded gradient, while backward fills it
        self.shard: Parameter | None = None
        self.pending = 0
        self.request: Any = None     # an allgather in flight (stage 3 prefetch)
        self.reduced = False

    # -- the full flat parameters ------------------------------------------------------------
    def new_flat(self) -> Any:
        return self.xp.zeros(self.padded, dtype=self.dtype)

    def new_grad_flat(self) -> Any:
        return self.xp.zeros(self.padded, dtype=self.grad_dtype)

    def point_params_at(self, flat: Any) -> None:
        """Make each member's ``.data`` its view of ``flat`` (the full parameters)."""
        self.flat = flat
        for p, a, b, shape in zip(self.params, self.offsets, self.offsets[1:], self.shapes):
            p.data = flat[a:b].reshape(shape)

    def release_params(self) -> None:
        """Drop the full parameters (stage 3): members keep an empty placeholder."""
        self.flat = None
        empty = self.xp.empty(0, dtype=self.dtype)
        for p in self.params:
            p.data = empty

    # -- gradients ---------------------------------------------------------------------------
    def attach_grads(self, flat: Any) -> None:
        """Backward writes each member's gradient into its view of ``flat``."""
        self.grad_flat = flat
        for p, a, b, shape in zip(self.params, self.offsets, self.offsets[1:], self.shapes):
            view = flat[a:b].reshape(shape)
            p.grad_buffer = view
            if p.grad is not None and p.grad is not view:
                view[...] = p.grad
                p.grad = view

    def fill_missing(self) -> None:
        """Zero the gradient of members that got none (so every rank sums alike)."""
        for p, a, b, shape in zip(self.params, self.offsets, self.offsets[1:], self.shapes):
            if p.grad is None:
                view = self.grad_flat[a:b].reshape(shape)
                view[...] = 0
                p.grad = view

    def drop_grads(self) -> None:
        self.grad_flat = None
        for p in self.params:
            p.grad = None
            p.grad_buffer = None


def member_ranges(u: Unit) -> list[tuple[int, int, int, int]]:
    """(member index, first element, start, stop) of each member's part of this rank's
    block of unit ``u``: the member's first element held, and where its part lies in
    the block, ``[start, stop)``. Members without elements here are left out, and so is
    the padding."""
    out = []
    lo, hi = u.start, min(u.start + u.block, u.size)
    for k, (a, b) in enumerate(zip(u.offsets, u.offsets[1:])):
        x, y = max(lo, a), min(hi, b)
        if x < y:
            out.append((k, x - a, x - lo, y - lo))
    return out


def member_slices(u: Unit, block: Any) -> list[tuple[Parameter, int, Any]]:
    """(parameter, first element, values) of each member's part of ``block`` (this
    rank's block of unit ``u``, or an array shaped like it: its gradient, optimizer
    state)."""
    return [(u.params[k], first, block[start:stop])
            for k, first, start, stop in member_ranges(u)]


__all__ = ["Unit", "member_ranges", "member_slices"]
