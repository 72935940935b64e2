"""Layer-wise adaptive optimizers: where each model tensor is, and its norms on every layout.

LARS and LAMB scale each parameter tensor's update by a *trust ratio* built from the
tensor's norm and its update's norm. The optimizer does not always see whole tensors:

- data parallelism: every rank holds every tensor whole;
- ZeRO: the optimizer's parameters are flat blocks of units, a block holds pieces of
  several tensors and a tensor's elements are spread over the ranks of ``shards``;
- tensor parallelism: a split tensor's rows or columns are spread over ``tensor``, while
  a replicated one (a LayerNorm) is whole, and alike, on every rank of it.

:class:`TensorNorms` says which elements of which optimizer parameter belong to which
model tensor (:class:`Segment`), and turns each rank's per-tensor sums of squares into
the tensors' full sums with one allreduce per group, whatever the number of tensors
(never one collective per tensor). Tensor indices are the model's parameter order, the
same on every rank, so the ranks' sums line up element for element.

:class:`LayerwiseOptimizer` is the two-pass step both optimizers share: the elementwise
state update and the local sums, one reduction, then the scaled update per segment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module
from mpidl.optim.optimizer import Optimizer


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of an optimizer parameter (flattened) that belong to
    model tensor ``tensor``."""

    start: int
    stop: int
    tensor: int


class TensorNorms:
    """Where the model's tensors are among an optimizer's parameters, and on which ranks.

    Args:
        segments: for each optimizer parameter, the segments it holds (parameters or
            parts of them that belong to no tensor, such as ZeRO's padding, are in none).
        excluded: for each model tensor, whether it is left out of the trust ratio and
            the weight decay: biases and normalisation parameters (You et al.'s
            exclusions; :func:`is_excluded`).
        split: for each model tensor, whether its elements are split over ``tensor``
            (tensor parallelism); the others are whole and alike on every rank of it.
        shards: the group over which every tensor's elements are split disjointly
            (ZeRO's replicas), or None.
        tensor: the tensor-parallel group, or None.
    """

    def __init__(self, segments: Sequence[Sequence[Segment]], excluded: Sequence[bool],
                 split: Sequence[bool] | None = None, shards: Any = None,
                 tensor: Any = None) -> None:
        self.segments = [list(s) for s in segments]
        self.excluded = numpy.asarray(excluded, dtype=bool)
        self.count = len(self.excluded)
        self.split = (numpy.zeros(self.count, dtype=bool) if split is None
                      else numpy.asarray(split, dtype=bool))
        for i, segs in enumerate(self.segments):
            for s in segs:
                if not 0 <= s.tensor < self.count or s.start >= s.stop:
                    raise ValueError(f"TensorNorms: parameter {i} has segment {s}, outside "
                                     f"the {self.count} tensors or empty")
        self.shards, self.tensor = shards, tensor
        # Host masks on a device, made once (copied from the host every step before #48).
        self._on_device: dict[tuple[str, int], Any] = {}

    @classmethod
    def whole(cls, params: Iterable[Tensor], split: Sequence[bool] | None = None,
              tensor: Any = None) -> "TensorNorms":
        """Each parameter is one whole model tensor (one rank, data parallelism, or with
        ``split`` and ``tensor`` a tensor-parallel model's shards)."""
        params = list(params)
        return cls([[Segment(0, int(p.data.size), i)] if p.data.size else []
                    for i, p in enumerate(params)],
                   [is_excluded(p.shape) for p in params], split, tensor=tensor)

    def on_device(self, name: str, xp: Any) -> Any:
        """The mask ``name`` ("excluded", or "replicated": not split) as an ``xp``
        array, copied to the device once."""
        key = (name, id(xp))
        if key not in self._on_device:
            host = self.excluded if name == "excluded" else ~self.split
            self._on_device[key] = host if xp is numpy else xp.asarray(host)
        return self._on_device[key]

    def reduce(self, sums: Any) -> Any:
        """Each tensor's full sums from this rank's: ``sums`` ``(k, count)`` float64 xp
        array, reduced in place and returned. Collective over ``shards`` and ``tensor``
        when they hold more than one rank (every rank calls it once per step, with or
        without segments)."""
        if self.shards is not None and self.shards.size > 1:
            self.shards.allreduce_(sums)
        if self.tensor is not None and self.tensor.size > 1:
            if self.tensor.rank != 0:
                # A replicated tensor is whole on every rank: rank 0's sums are its
                # sums, and zeros from the others keep them exact.
                sums[:, self.on_device("replicated", get_array_module(sums))] = 0
            self.tensor.allreduce_(sums)
        return sums


def is_excluded(shape: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` is a bias or a normalisation parameter (1-D or a
    scalar): kept out of the trust ratio and weight decay, as LARS and LAMB do."""
    return len(tuple(shape)) <= 1


class LayerwiseOptimizer(Optimizer):
    """An optimizer whose update of each model tensor is scaled by a trust ratio.

    A step is two passes over this rank's parameters with one reduction between them
    (:meth:`TensorNorms.reduce`, collective when the tensors span ranks):

    1. :meth:`_prepare` updates the elementwise state and returns the arrays whose
       per-tensor sums of squares the ratio needs; they are summed per segment;
    2. :meth:`_apply` updates each segment with its tensor's ratio.

    Subclasses define ``_prepare``, ``_ratios`` and ``_apply``. ``norms`` defaults to
    every parameter a whole tensor (:meth:`TensorNorms.whole`).
    """

    sums = 2  # arrays summed per tensor in pass 1

    def __init__(self, params: Iterable[Tensor], lr: float,
                 norms: TensorNorms | None = None) -> None:
        super().__init__(params, lr)
        self.norms = norms if norms is not None else TensorNorms.whole(self.params)
        if len(self.norms.segments) != len(self.params):
            raise ValueError(f"{type(self).__name__}: norms describe "
                             f"{len(self.norms.segments)} parameters, the optimizer has "
                             f"{len(self.params)}; build them from the same parameter list")

    def step(self) -> None:
        """Update every parameter that has a gradient, in place. Collective over the
        norms' groups (every rank calls it, with or without gradients)."""
        lr = self.lr
        xp = get_array_module(self.params[0].data)
        sums = xp.zeros((self.sums, self.norms.count), dtype=xp.float64)
        active = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            active.append(i)
            arrays = self._prepare(i, p)
            for s in self.norms.segments[i]:
                for k, a in enumerate(arrays):
                    piece = a.reshape(-1)[s.start:s.stop]
                    piece = piece.astype(xp.promote_types(piece.dtype, xp.float32), copy=False)
                    sums[k, s.tensor] += xp.dot(piece, piece)
        ratios = self._ratios(xp.sqrt(self.norms.reduce(sums)))
        for i in active:
            self._apply(i, self.params[i], ratios, lr)
        self.step_count += 1

    def _prepare(self, i: int, p: Tensor) -> Sequence[Any]:
        """Pass 1 for parameter ``i``: state update; the arrays to sum squares of."""
        raise NotImplementedError

    def _ratios(self, norms: Any) -> Any:
        """The trust ratio of every tensor from the reduced norms ``(sums, count)``."""
        raise NotImplementedError

    def _apply(self, i: int, p: Tensor, ratios: Any, lr: float) -> None:
        """Pass 2 for parameter ``i``: the update, segment by segment."""
        raise NotImplementedError


def trust(numerator: Any, denominator: Any, excluded: Any, max_trust: float | None) -> Any:
    """``numerator / denominator`` per tensor clipped at ``max_trust``, and 1 where
    either is 0 or the tensor is excluded: the ratio rule LARS and LAMB share (an update
    of a zero tensor, or a zero update, is not rescaled; nor is an excluded tensor's)."""
    xp = get_array_module(numerator)
    ok = (numerator > 0) & (denominator > 0) & ~xp.asarray(excluded)
    ratio = numerator / xp.where(ok, denominator, 1.0)
    if max_trust is not None:
        ratio = xp.minimum(ratio, max_trust)
    return xp.where(ok, ratio, 1.0)


__all__ = ["Segment", "TensorNorms", "LayerwiseOptimizer", "is_excluded", "trust"]
