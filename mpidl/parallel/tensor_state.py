"""A tensor-parallel model's state: full arrays under the single-rank names, and the
records of a sharded checkpoint.

A sharded parameter (:mod:`mpidl.parallel.tensor`) carries a ``shard``, a
:class:`~mpidl.parallel.tensor.Shard` that says how to cut it out of the full array and
put it back together. :func:`full_state_dict` and :func:`full_optimizer_state` gather
every sharded array over its tensor group (the single-rank model's and optimizer's
state dicts, so a checkpoint loads into any layout); :func:`load_full_state_dict` and
:func:`load_full_optimizer_state` keep this rank's piece of them. :func:`shard_runs`
and :func:`holdings` describe what this rank holds, as the typed records of
:mod:`mpidl.parallel.holdings`, for the sharded checkpoint format (each rank writes its
own pieces, :mod:`mpidl.train.sharded`). Public through :mod:`mpidl.parallel.tensor`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy

from mpidl.nn.module import Module
from mpidl.parallel.holdings import merge, parameter_holdings, whole

if TYPE_CHECKING:  # tensor.py imports this module: Shard is named for the types only
    from mpidl.parallel.tensor import Shard


# -- full (unsharded) state ----------------------------------------------------------------
def full_state_dict(model: Module) -> dict[str, Any]:
    """``{name: full array}`` of every parameter, under the single-rank model's names.

    Collective over each sharded parameter's group (every rank of the tensor group calls
    it; the other axes hold replicas and may call it too). Sharded parameters are
    gathered into new arrays; replicated ones are their live arrays, as
    :meth:`~mpidl.nn.Module.state_dict` gives them.
    """
    out = {}
    for name, p in model.named_parameters():
        shard = getattr(p, "shard", None)
        out[name] = shard.gather(p.data) if shard is not None else p.data
    return out


def load_full_state_dict(model: Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load full (unsharded) arrays, keeping each sharded parameter's piece.

    Not collective: every rank needs the full ``state`` (read from the same checkpoint).
    Arguments and errors as :meth:`~mpidl.nn.Module.load_state_dict`.
    """
    local = dict(state)
    local.update({n: p.shard.take(state[n]) for n, p in model.named_parameters()
                  if getattr(p, "shard", None) is not None and n in state})
    model.load_state_dict(local, strict=strict)


def _shards_by_index(optimizer: Any, model: Module) -> list[Shard | None]:
    shards = {id(p): getattr(p, "shard", None) for p in model.parameters()}
    missing = [i for i, p in enumerate(optimizer.params) if id(p) not in shards]
    if missing:
        raise ValueError(f"optimizer parameters {missing} are not parameters of the model")
    return [shards[id(p)] for p in optimizer.params]


def _per_parameter(state: dict[str, Any], shards: list[Shard | None], op: Any
                   ) -> dict[str, Any]:
    """``state`` (an optimizer's layout: ``state.<i>.<name>`` per parameter ``i``) with
    ``op(shard, array)`` applied to every array of a sharded parameter."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        shard = shards[int(parts[1])] if (parts[0] == "state" and len(parts) == 3
                                          and parts[1].isdigit()
                                          and int(parts[1]) < len(shards)) else None
        out[key] = op(shard, value) if shard is not None and hasattr(value, "shape") \
            else value
    return out


def full_optimizer_state(optimizer: Any, model: Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every per-parameter array of a sharded parameter full.

    With the optimizer built on ``model.parameters()`` (the single-rank model's order),
    the result is what the single-rank optimizer's state dict would be. Collective as
    :func:`full_state_dict`.
    """
    return _per_parameter(optimizer.state_dict(), _shards_by_index(optimizer, model),
                          lambda shard, a: shard.gather(a))


def load_full_optimizer_state(optimizer: Any, model: Module, state: dict[str, Any]) -> None:
    """Load a :func:`full_optimizer_state` (from any layout) into this rank's optimizer."""
    optimizer.load_state_dict(_per_parameter(state, _shards_by_index(optimizer, model),
                                             lambda shard, a: shard.take(a)))


# -- what a sharded checkpoint records ------------------------------------------------------
def shard_runs(p: Any, shape: tuple) -> tuple[tuple, Any]:
    """The full shape of parameter ``p`` (this rank's, of local ``shape``) and the runs
    of its elements in the full array's flat order (:mod:`mpidl.parallel.holdings`).

    Along the split axis the full array is ``groups`` parts of ``n`` rows and this rank
    holds rows ``start..start+c`` of each: one run per (outer index, group) of ``c``
    rows times the inner size.
    """
    shard = getattr(p, "shard", None)
    if shard is None:
        return tuple(shape), whole(shape)
    n, c = sum(shard.counts), shard.counts[shard.comm.rank]
    full = list(shape)
    full[shard.axis] = shard.groups * n
    outer = int(numpy.prod(shape[:shard.axis], dtype=numpy.int64))
    inner = int(numpy.prod(shape[shard.axis + 1:], dtype=numpy.int64))
    o = numpy.arange(outer, dtype=numpy.int64)[:, None]
    g = numpy.arange(shard.groups, dtype=numpy.int64)[None, :]
    starts = ((o * shard.groups + g) * n + shard.start) * inner
    runs = numpy.stack([starts.reshape(-1), numpy.full(starts.size, c * inner)], axis=1)
    return tuple(full), merge(runs)


def holdings(model: Module, optimizer: Any, writes: bool, tensor_rank: int) -> tuple:
    """The :class:`~mpidl.parallel.holdings.Held` records of a tensor-parallel model
    (and its optimizer, built over ``model.parameters()``; None: the model only).

    ``writes``: this rank is the replica that writes (the first of its replica group);
    a parameter that is not split is written by tensor rank 0 of it only.
    """
    def owner(p: Any) -> bool:
        return writes and (getattr(p, "shard", None) is not None or tensor_rank == 0)
    return parameter_holdings(list(model.named_parameters()), list(model.named_buffers()),
                              optimizer, shard_runs, owner, writes and tensor_rank == 0)


__all__ = ["full_state_dict", "load_full_state_dict", "full_optimizer_state",
           "load_full_optimizer_state", "shard_runs", "holdings"]
