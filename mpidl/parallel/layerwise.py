"""Where a wrapped model's tensors are, for the layer-wise optimizers (LARS, LAMB).

A wrapper's :meth:`tensor_norms` builds the :class:`~mpidl.optim.TensorNorms` of the
parameters it gives the optimizer, with the functions here:

- :func:`whole_tensor_norms`: the optimizer updates the model's own parameters (data
  parallelism), each a whole tensor, or on a tensor-parallel grid a shard of one
  (parameters with a ``shard``, :mod:`mpidl.parallel.tensor`) whose norm adds up over
  the tensor group;
- :func:`unit_tensor_norms`: the optimizer updates ZeRO's flat shards of units, each
  holding parts of several tensors, every tensor's parts spread over the replicas.

Model tensors are numbered in the units' member order (the model's parameter order),
the same on every rank.
"""
from __future__ import annotations

from typing import Any, Sequence

from mpidl.optim.layerwise import Segment, TensorNorms, is_excluded
from mpidl.parallel.units import Unit, member_ranges


def is_split(p: Any) -> bool:
    """Whether parameter ``p`` is a tensor-parallel shard (its norm spans the group)."""
    return getattr(p, "shard", None) is not None


def whole_tensor_norms(params: Sequence[Any], tensor: Any = None) -> TensorNorms:
    """Norms of ``params``, each a whole tensor or (with ``tensor``) a shard of one."""
    split = [tensor is not None and is_split(p) for p in params]
    return TensorNorms.whole(params, split=split, tensor=tensor)


def unit_tensor_norms(units: Sequence[Unit], shards: Any, tensor: Any = None) -> TensorNorms:
    """Norms of the shards of ``units`` (one optimizer parameter per unit with a block,
    in order) over the ``shards`` group, and ``tensor`` for tensor-parallel members."""
    first = 0
    segments, excluded, split = [], [], []
    for u in units:
        if u.block:
            segments.append([Segment(start, stop, first + k)
                             for k, _, start, stop in member_ranges(u)])
        excluded += [is_excluded(shape) for shape in u.shapes]
        split += [tensor is not None and is_split(p) for p in u.params]
        first += len(u.params)
    return TensorNorms(segments, excluded, split, shards=shards, tensor=tensor)


__all__ = ["whole_tensor_norms", "unit_tensor_norms", "is_split"]
