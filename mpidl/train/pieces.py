"""A checkpoint's state as pieces: the :class:`Source` interface, the loader that sets a
rank's records (:mod:`mpidl.parallel.holdings`) from any source, and the sources of the
single-file formats.

A source names every tensor of the single-rank state by its :class:`Key`, with its
shape and dtype, and gives it in pieces, each a set of runs of the full tensor's flat
elements. :func:`load` copies into each record only the elements it holds, from only the
pieces whose range overlaps them; :func:`assemble` builds one whole tensor. A sharded
checkpoint's pieces are the ranks' parts (:mod:`mpidl.train.sharded`); a single file's
(formats 1 and 2) are its tensors, each one piece read whole (one tensor at a time,
checked against its CRC-32).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy

from mpidl.backend import named_dtype
from mpidl.optim.master import MASTER
from mpidl.parallel.holdings import Held, HeldInt, Key, overlap, whole
from mpidl.train import checkpoint_file as ckpt
from mpidl.train.checkpoint_file import CheckpointError


class Piece:
    """Part of one full tensor in a checkpoint: elements ``[first, last)`` at most."""

    first: int
    last: int

    def runs(self) -> numpy.ndarray:
        """The piece's elements as runs of the full tensor, in its stored order."""
        raise NotImplementedError

    def copy_into(self, target: numpy.ndarray, segments: numpy.ndarray) -> None:
        """``target[a:a+n] = piece[b:b+n]`` for each row ``(a, b, n)`` of ``segments``
        (increasing ``b``), reading and checking only what they need."""
        raise NotImplementedError


class Source:
    """A checkpoint's state, tensor by tensor, in pieces. Not collective.

    Attributes:
        path: the checkpoint (the index file, or the single file).
        keys: every tensor's full shape and dtype name, by :class:`Key`.
        ints: the optimizer's per-parameter integers, by key.
        optimizer: ``{"step", "lr"}``, or None when the checkpoint has no optimizer.
    """

    path: str
    keys: dict[Key, tuple[tuple, str]]
    ints: dict[Key, int]
    optimizer: dict[str, Any] | None

    def pieces(self, key: Key) -> list[Piece]:
        raise NotImplementedError

    def close(self) -> None:
        """Close the files opened."""

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _WholePiece(Piece):
    """A tensor of a single-file checkpoint: one piece, read whole (one tensor)."""

    def __init__(self, get: Any, size: int) -> None:
        self.get, self.first, self.last = get, 0, size

    def runs(self) -> numpy.ndarray:
        return whole((self.last,))

    def copy_into(self, target: numpy.ndarray, segments: numpy.ndarray) -> None:
        data = numpy.asarray(self.get()).reshape(-1)
        for to, at, n in segments:
            target[to:to + n] = data[at:at + n]


class StateSource(Source):
    """A checkpoint whose tensors are whole (formats 1 and 2, or a state in memory):
    ``model`` by name, ``optimizer`` in the optimizer's layout over ``order``."""

    def __init__(self, path: str, model: Mapping[str, Any], optimizer: Mapping[str, Any],
                 order: list[str], file: Any = None) -> None:
        self.path, self.model, self.state, self.file = path, model, optimizer, file
        self.keys, self.ints, self._where = {}, {}, {}
        for name, value in model.items():
            self._add(Key("model", name), value, ("model", name))
        self.optimizer = ({"step": int(optimizer["step"]), "lr": float(optimizer["lr"])}
                          if "step" in optimizer else None)
        for name, value in optimizer.items():
            parts = name.split(".")  # the optimizer's own layout: state.<i>.<name>
            if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
                continue
            i = int(parts[1])
            if i >= len(order):
                raise KeyError(f"optimizer state {name!r} of checkpoint {path} names "
                               f"parameter {i}; the model has {len(order)}")
            key = Key("optimizer", order[i], parts[2])
            if hasattr(value, "shape"):
                self._add(key, value, ("optimizer", name))
            else:
                self.ints[key] = int(value)

    def _add(self, key: Key, value: Any, where: tuple[str, str]) -> None:
        self.keys[key] = (tuple(value.shape), str(value.dtype))
        self._where[key] = where

    def pieces(self, key: Key) -> list[Piece]:
        if key not in self._where:
            return []
        group, name = self._where[key]
        tree = self.model if group == "model" else self.state
        return [_WholePiece(lambda: tree[name], int(numpy.prod(self.keys[key][0],
                                                               dtype=numpy.int64)))]

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _read_checked(value: Any, verify: bool, where: str) -> Any:
    """An array of a single-file checkpoint: an HDF5 dataset is read and checked."""
    if not hasattr(value, "attrs"):
        return value
    array = ckpt.restored(value[...], value.attrs.get(ckpt._DTYPE_ATTR))
    if verify and value.attrs.get(ckpt._CRC_ATTR) != ckpt._crc(array):
        raise CheckpointError(f"checkpoint {where} is corrupt: {value.name} (shape "
                              f"{array.shape}, {array.dtype}) fails its checksum")
    return array


def file_source(path: str, order: list[str]) -> StateSource:
    """A format-1 or -2 single file, its tensors read one at a time as they are needed
    (checked against their CRC-32s). ``order``: the parameters' names in the optimizer's
    order (the single-rank model's)."""
    f = ckpt._h5py().File(path, "r", locking=False)
    try:
        verify = int(f.attrs["format_version"]) >= 2
        plain = ckpt._read_tree(f["optimizer"], verify, arrays=False)
        model = {k: _Lazy(v, verify, path) for k, v in f["model"].items()
                 if not hasattr(v, "keys")}
        optimizer = {**plain, **{k: _Lazy(v, verify, path) for k, v in f["optimizer"].items()
                                 if not hasattr(v, "keys")}}
        return StateSource(path, model, optimizer, order, file=f)
    except BaseException:
        f.close()
        raise


class _Lazy:
    """A dataset read (and checked) when a piece of it is copied; its ``dtype`` is the
    tensor's (:func:`~mpidl.train.checkpoint_file.restored_dtype`), not the stored one."""

    def __init__(self, dataset: Any, verify: bool, path: str) -> None:
        self.dataset, self.verify, self.path = dataset, verify, path
        self.shape, self.dtype = dataset.shape, ckpt.restored_dtype(dataset)

    def __array__(self, dtype: Any = None, copy: Any = None) -> numpy.ndarray:
        array = _read_checked(self.dataset, self.verify, self.path)
        return array if dtype is None else array.astype(dtype)


# -- another precision ------------------------------------------------------------------------

class _OtherPrecision(Source):
    """A source whose tensors are read under other keys (:func:`across_precision`)."""

    def __init__(self, source: Source, alias: Mapping[Key, Key], hidden: set[Key]) -> None:
        self.source, self.alias = source, dict(alias)
        self.path, self.ints, self.optimizer = source.path, source.ints, source.optimizer
        self.keys = {k: v for k, v in source.keys.items() if k not in hidden}
        self.keys.update({k: source.keys[v] for k, v in self.alias.items()})

    def pieces(self, key: Key) -> list[Piece]:
        return self.source.pieces(self.alias.get(key, key)) if key in self.keys else []

    def close(self) -> None:
        self.source.close()


def across_precision(source: Source, order: Iterable[str], arrays: Iterable[str]) -> Source:
    """``source`` as a checkpoint of this run's precision.

    A half-precision run (fp16, bf16) keeps an fp32 master of each parameter as optimizer
    state ``master`` (:mod:`mpidl.optim.master`); a float32 run has none. Resuming a half
    run in float32 loads each parameter from its master (the exact fp32 values, not the
    half copy rounded from them) and leaves the masters out; resuming a float32 run in
    half precision makes each master from the float32 parameter (the half parameter is
    that value rounded once, as after every step). The other optimizer arrays are fp32
    in both. ``order``: the parameters' names; ``arrays``: this run's optimizer arrays.
    """
    order, wants = list(order), MASTER in set(arrays)
    masters = {n: Key("optimizer", n, MASTER) for n in order}
    has = [n for n in order if masters[n] in source.keys]
    if wants and not has:
        return _OtherPrecision(source, {masters[n]: Key("model", n) for n in order
                                        if Key("model", n) in source.keys}, set())
    if has and not wants:
        return _OtherPrecision(source, {Key("model", n): masters[n] for n in has},
                               {masters[n] for n in has})
    return source


# -- loading records ----------------------------------------------------------------------------

def check_keys(source: Source, model_names: Iterable[str], arrays: Iterable[str],
               group: str) -> None:
    """KeyError unless the checkpoint's tensors of ``group`` are those of this model
    (``model_names``: parameters and buffers) and optimizer (its ``arrays``)."""
    names = set(model_names)
    have = [k for k in source.keys if k.group == group]
    if group == "model":
        missing = sorted(names - {k.name for k in have})
        unexpected = sorted({k.name for k in have} - names)
    else:
        missing = []
        unexpected = sorted(k.path() for k in have
                            if k.name not in names or k.array not in set(arrays))
    if missing or unexpected:
        said = [f"missing keys {missing[:5]}"] if missing else []
        said += [f"unexpected keys {unexpected[:5]}"] if unexpected else []
        raise KeyError(f"checkpoint {source.path}: {' and '.join(said)}")


def load(source: Source, held: Iterable[Held], ints: Iterable[HeldInt] = (),
         group: str | None = None) -> int:
    """Set each record (of ``group``, or all) from the source: only the pieces that
    overlap it, only the blocks of them that do; return the elements read. A record
    whose tensor the checkpoint lacks is an error for the model, and left as it is for
    the optimizer (a parameter that never had a gradient has no state). Not collective.

    Raises:
        ValueError: a tensor of another shape.
        CheckpointError: a piece missing, unreadable or failing its checksum.
    """
    read = 0
    for h in held:
        if (group is not None and h.key.group != group) or not h.count:
            continue
        if h.key not in source.keys:
            if h.key.group == "model":
                raise KeyError(f"checkpoint {source.path} has no {h.key.path()}")
            continue
        shape, dtype = source.keys[h.key]
        if tuple(shape) != tuple(h.shape):
            raise ValueError(f"{h.key.path()} has shape {tuple(shape)} in checkpoint "
                             f"{source.path}, {tuple(h.shape)} in the model")
        target = numpy.empty(h.count, dtype=named_dtype(dtype))
        covered = 0
        first, last = h.bounds
        for piece in source.pieces(h.key):
            if piece.last <= first or piece.first >= last:
                continue
            segments = overlap(h.runs, piece.runs())
            if len(segments):
                piece.copy_into(target, segments)
                covered += int(segments[:, 2].sum())
        if covered != h.count:
            raise CheckpointError(f"checkpoint {source.path}: the pieces of {h.key.path()} "
                                  f"cover {covered} of the {h.count} elements this rank "
                                  "holds; a part is missing from its index")
        h.write(target)
        read += covered
        del target
    for r in ints:
        if (group is None or r.key.group == group) and r.key in source.ints:
            r.write(source.ints[r.key])
    return read


def assemble(source: Source, key: Key) -> numpy.ndarray:
    """The whole tensor ``key`` from its pieces (for a full checkpoint, or eval)."""
    shape, dtype = source.keys[key]
    size = int(numpy.prod(shape, dtype=numpy.int64))
    out = numpy.empty(size, dtype=named_dtype(dtype))
    mine = whole((size,))
    covered = 0
    for piece in source.pieces(key):
        segments = overlap(mine, piece.runs())
        if len(segments):
            piece.copy_into(out, segments)
            covered += int(segments[:, 2].sum())
    if covered != size:
        raise CheckpointError(f"checkpoint {source.path}: the pieces of {key.path()} cover "
                              f"{covered} of its {size} elements")
    return out.reshape(shape)


__all__ = ["Piece", "Source", "StateSource", "file_source", "across_precision", "check_keys",
           "load", "assemble"]
