"""ZeRO's state in checkpoints: what a rank holds, for the sharded format
(:mod:`mpidl.train.sharded`), and the pieces of format 2, read for older checkpoints.

:func:`holdings` describes this rank's blocks of every parameter and optimizer array as
typed records (:mod:`mpidl.parallel.holdings`); :func:`refresh_after_load` brings the full
parameters of stages 1-2 up to date after a load. A format-2 ZeRO checkpoint has one
companion file per rank holding that rank's pieces ``{name: {start, shape, data}}`` of
the model and optimizer state (:func:`state_pieces` wrote them); :func:`pieces_to_full`
puts every rank's pieces back into the full, data-parallel state. :func:`load_full_state`
sets a rank's shards from a full state.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy

from mpidl import backend
from mpidl.parallel.holdings import Key, clip, optimizer_int, optimizer_state, record, whole_runs
from mpidl.parallel.units import Unit, member_slices
from mpidl.parallel.zero import ShardedDataParallel


# -- sharded checkpoints: what this rank holds, as typed records -----------------------------

def holdings(sdp: ShardedDataParallel, optimizer: Any, runs_of: Any = None,
             owner_of: Any = None, buffer_owner: bool | None = None) -> tuple[list, list]:
    """The :class:`~mpidl.parallel.holdings.Held` records of this rank's blocks: each
    member parameter's part of the block, and the same part of each optimizer array
    (None: the model only). Not collective.

    Args:
        runs_of: ``(parameter, its shape here)`` -> the single-rank shape and the runs of
            its elements (:func:`mpidl.parallel.tensor.shard_runs` on a grid); default:
            the parameter is the single-rank one.
        owner_of: whether this rank writes a parameter's part (default: yes: the blocks
            are this rank's alone); a grid's unsplit parameters are written by one
            tensor rank.
        buffer_owner: whether this rank writes the buffers (held whole on every rank);
            default: rank 0 of the group.
    """
    runs_of = runs_of or whole_runs
    owner_of = owner_of or (lambda p: True)
    names = {id(p): n for n, p in sdp.named}
    index = {id(s): i for i, s in enumerate(optimizer.params)} if optimizer is not None else {}
    held, ints = [], []
    for u in sdp.units:
        if not u.block:
            continue
        lo, hi = u.start, min(u.start + u.block, u.size)
        for p, a, b, shape in zip(u.params, u.offsets, u.offsets[1:], u.shapes):
            x, y = max(lo, a), min(hi, b)
            if x >= y:
                continue
            full, runs = runs_of(p, shape)
            runs, name, part = clip(runs, x - a, y - a), names[id(p)], slice(x - lo, y - lo)
            held.append(record(Key("model", name), full, u.dtype, runs,
                               lambda create, u=u, part=part: u.shard.data[part], owner_of(p)))
            if optimizer is None:
                continue
            i = index[id(u.shard)]
            dtype = numpy.dtype(optimizer.state_dtype(u.shard.data))
            for array in optimizer.state_arrays:
                held.append(record(Key("optimizer", name, array), full, dtype, runs,
                                   optimizer_state(optimizer, i, array, (u.block,), dtype,
                                                   part), owner_of(p)))
            for integer in optimizer.state_ints:
                ints.append(optimizer_int(optimizer, i, Key("optimizer", name, integer),
                                          owner_of(p)))
    writes = sdp.comm.rank == 0 if buffer_owner is None else buffer_owner
    for name, buf in sdp.module.named_buffers():
        full, runs = whole_runs(buf, tuple(buf.shape))
        held.append(record(Key("model", name), full, buf.dtype, runs,
                           lambda create, buf=buf: buf, writes))
    return held, ints


def refresh_after_load(sdp: ShardedDataParallel) -> None:
    """After this rank's blocks were set (a sharded checkpoint loaded): stages 1-2
    gather the full parameters from every rank's blocks. Collective."""
    sdp._stale = True
    sdp.gather_parameters()


def _pieces_of(u: Unit, names: dict[int, str], block: Any) -> list[tuple[str, int, Any]]:
    """(parameter name, first element, values) of each member's part of ``block``."""
    return [(names[id(p)], start, values) for p, start, values in member_slices(u, block)]


def state_pieces(sdp: "ShardedDataParallel", optimizer: Any) -> tuple[dict, dict]:
    """This rank's part of the model and optimizer state, keyed by parameter name.

    ``model[name] = {"start": e, "shape": full shape, "data": elements e..}`` for every
    parameter this rank's blocks touch (rank 0 adds the model's buffers whole);
    ``optimizer`` has ``step``, ``lr`` and
    ``state[name][array]`` pieces alike (and the per-parameter ints). Not collective:
    each rank writes its own (:mod:`mpidl.train.checkpoint` companions), nobody gathers.
    """
    names = {id(p): n for n, p in sdp.named}
    shapes = {names[id(p)]: list(s) for u in sdp.units for p, s in zip(u.params, u.shapes)}
    model: dict[str, Any] = {}
    if sdp.comm.rank == 0:  # buffers (running statistics, input scales) are not sharded:
        for name, b in sdp.module.named_buffers():  # rank 0's whole, as DP saves them
            b = numpy.asarray(backend.as_numpy(b))
            model[name] = {"start": 0, "shape": list(b.shape), "data": b.reshape(-1)}
    opt_state: dict[str, Any] = {}
    full = optimizer.state_dict()
    index = {id(s): i for i, s in enumerate(optimizer.params)}
    for u in sdp.units:
        if not u.block:
            continue
        for name, start, data in _pieces_of(u, names, u.shard.data):
            model[name] = {"start": start, "shape": shapes[name], "data": data}
        i = index[id(u.shard)]
        for array in getattr(optimizer, "state_arrays", ()):
            key = f"state.{i}.{array}"
            if key in full:
                for name, start, data in _pieces_of(u, names, full[key]):
                    opt_state.setdefault(name, {})[array] = {
                        "start": start, "shape": shapes[name], "data": data}
        for integer in getattr(optimizer, "state_ints", ()):
            key = f"state.{i}.{integer}"
            if key in full:
                for name, _, _ in _pieces_of(u, names, u.shard.data):
                    opt_state.setdefault(name, {})[integer] = int(full[key])
    return model, {"step": full["step"], "lr": full["lr"], "state": opt_state}


def load_full_state(sdp: "ShardedDataParallel", model: dict[str, Any],
                    optimizer_state: dict[str, Any] | None, optimizer: Any) -> None:
    """Set this rank's shards (and its optimizer's state) from full, data-parallel state:
    ``model`` by parameter name, ``optimizer_state`` in the optimizer's own layout over
    the model's parameters (``state.<i>.<name>``, ``i`` in ``model.named_parameters()``
    order), as :func:`mpidl.train.checkpoint.load_checkpoint` returns both for any
    checkpoint. Not collective. Stages 1-2 also refresh the full parameters."""
    xp = sdp.units[0].xp if sdp.units else numpy
    order = {n: i for i, (n, _) in enumerate(sdp.named)}
    names = {id(p): n for n, p in sdp.named}
    buffers = dict(sdp.module.named_buffers())
    missing = [n for n, _ in sdp.named if n not in model]
    missing += [n for n in buffers if n not in model]
    unexpected = [n for n in model if n not in order and n not in buffers]
    if missing or unexpected:
        raise KeyError(f"the state lacks parameters or buffers {missing[:5]} and has "
                       f"others {unexpected[:5]}" if unexpected else
                       f"the state lacks parameters or buffers {missing[:5]}")
    for name, b in buffers.items():
        v = numpy.asarray(backend.as_numpy(model[name]))
        if tuple(v.shape) != tuple(b.shape):
            raise ValueError(f"buffer {name!r} has shape {tuple(v.shape)} in the state, "
                             f"{tuple(b.shape)} in the model")
        b[...] = xp.asarray(v)  # in place: the module keeps its array
    new_opt: dict[str, Any] = {"step": 0, "lr": optimizer.lr}
    if optimizer_state is not None:
        new_opt.update(step=optimizer_state["step"], lr=optimizer_state["lr"])
    index = {id(s): i for i, s in enumerate(optimizer.params)}

    def unit_block(u: Unit, values: dict[str, Any]) -> Any:
        flat = numpy.zeros(u.padded, dtype=u.dtype)
        for p, a, b, shape in zip(u.params, u.offsets, u.offsets[1:], u.shapes):
            v = numpy.asarray(backend.as_numpy(values[names[id(p)]]))
            if tuple(v.shape) != tuple(shape):
                raise ValueError(f"parameter {names[id(p)]!r} has shape {tuple(v.shape)} in "
                                 f"the state, {tuple(shape)} in the model")
            flat[a:b] = v.reshape(-1)
        return flat[u.start:u.start + u.block]

    for u in sdp.units:
        if not u.block:
            continue
        u.shard.data[...] = xp.asarray(unit_block(u, model))
        if optimizer_state is None:
            continue
        i = index[id(u.shard)]
        first = order[names[id(u.params[0])]]
        for array in getattr(optimizer, "state_arrays", ()):
            per_param = {n: optimizer_state.get(f"state.{order[n]}.{array}")
                         for n in (names[id(p)] for p in u.params)}
            if all(v is not None for v in per_param.values()):
                new_opt[f"state.{i}.{array}"] = xp.asarray(unit_block(u, per_param))
        for integer in getattr(optimizer, "state_ints", ()):
            value = optimizer_state.get(f"state.{first}.{integer}")
            if value is not None:
                new_opt[f"state.{i}.{integer}"] = int(value)
    optimizer.load_state_dict(new_opt)
    if sdp.stage < 3:
        for u in sdp.units:  # every rank holds all blocks: its full parameters from them
            u.flat[...] = xp.asarray(_full_flat(u, model, names))
        sdp._stale = False


def _full_flat(u: Unit, model: dict[str, Any], names: dict[int, str]) -> Any:
    flat = numpy.zeros(u.padded, dtype=u.dtype)
    for p, a, b in zip(u.params, u.offsets, u.offsets[1:]):
        flat[a:b] = numpy.asarray(backend.as_numpy(model[names[id(p)]])).reshape(-1)
    return flat


def assemble(pieces: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """Full arrays by name from every rank's pieces (``{name: {start, shape, data}}``)."""
    out: dict[str, Any] = {}
    for name in order:
        parts = [p[name] for p in pieces if name in p]
        if not parts:
            raise KeyError(f"no piece of parameter {name!r} in any file")
        shape = tuple(parts[0]["shape"])
        flat = numpy.empty(int(numpy.prod(shape, dtype=numpy.int64)),
                           dtype=parts[0]["data"].dtype)
        covered = 0
        for part in parts:
            data = numpy.asarray(part["data"]).reshape(-1)
            flat[part["start"]:part["start"] + data.size] = data
            covered += data.size
        if covered != flat.size:
            raise ValueError(f"the pieces of {name!r} cover {covered} of {flat.size} elements")
        out[name] = flat.reshape(shape)
    return out


def pieces_to_full(model_pieces: list[dict[str, Any]], optimizer_pieces: list[dict[str, Any]],
                   order: list[str], buffers: Sequence[str] = ()
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank's pieces (as :func:`state_pieces` wrote them) back into full state:
    the model by name (parameters in ``order``, then the ``buffers``), the optimizer in
    its data-parallel layout (``state.<i>.<name>`` with ``i`` in ``order``), so that data
    parallelism, evaluation and any stage at any rank count load a sharded checkpoint
    alike."""
    model = assemble(model_pieces, [*order, *buffers])
    first = next((o for o in optimizer_pieces if o), {"step": 0, "lr": 0.0})
    optimizer: dict[str, Any] = {"step": first["step"], "lr": first["lr"]}
    states = [o.get("state", {}) for o in optimizer_pieces]
    kinds: dict[str, bool] = {}  # name of a state entry -> is it an array
    for st in states:
        for entries in st.values():
            for key, value in entries.items():
                kinds[key] = isinstance(value, dict)
    for i, name in enumerate(order):
        for key, is_array in kinds.items():
            if is_array:
                parts = [{name: st[name][key]} for st in states
                         if name in st and key in st[name]]
                if parts:
                    optimizer[f"state.{i}.{key}"] = assemble(parts, [name])[name]
            else:
                value = next((st[name][key] for st in states
                              if name in st and key in st[name]), None)
                if value is not None:
                    optimizer[f"state.{i}.{key}"] = int(value)
    return model, optimizer


__all__ = ["holdings", "refresh_after_load", "state_pieces", "load_full_state", "assemble",
           "pieces_to_full"]
