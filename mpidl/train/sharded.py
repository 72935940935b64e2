"""Sharded checkpoints: every rank writes its own part, one index names every piece.

Layout of a sharded checkpoint of step 1200 (format version 3)::

    checkpoint-00001200.h5             the index, written last by rank 0: step, epoch,
                                       config, rng, sampler, extra (as format 2), and
                                       index/: every tensor's key, shape and dtype, and
                                       every piece's key, part, dataset, element count,
                                       CRC-32 and [first, last) element range
    checkpoint-00001200.h5.part-00003  rank 3's pieces: one flat dataset per piece
                                       (``<n>``) in the rank's own element order, its
                                       runs beside it (``<n>.runs``, (k, 2) start and
                                       length in the full tensor's flat order), a CRC-32
                                       per block of 4 MiB and of the whole

An index that exists means all its parts exist (each part is written atomically before
it). A rank reads only the pieces whose element range overlaps what it will hold, and of
those only the blocks holding the overlap, each checked against its CRC-32 before use:
resharding to another rank count or layout reads no more than its own share, plus at
most a block at each end of a run. Memory while saving or loading: the rank's own state,
one tensor's share of it and one block.

Where the records come from (which rank holds which elements): :mod:`mpidl.parallel.holdings`.
The single-file formats (1 and 2) and format 2's ZeRO companions load through the same
:class:`Source` interface: each of their tensors is one piece covering it all.
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Any, Iterable, Mapping

import numpy

from mpidl import storage
from mpidl.backend import as_numpy
from mpidl.parallel.holdings import Held, Key, runs_array
from mpidl.train import checkpoint_file as ckpt
from mpidl.train.checkpoint_file import CheckpointError
from mpidl.train.pieces import Piece, Source, assemble

SHARDED_VERSION = 3
BLOCK_BYTES = 4 << 20  # a CRC-32 per block: a partial read checks what it reads


def part_name(step: int, rank: int) -> str:
    """The file of rank ``rank``'s part of the sharded checkpoint of ``step``."""
    return f"{ckpt.checkpoint_name(step)}.part-{int(rank):05d}"


def _text(obj: Any) -> numpy.ndarray:
    """JSON as a uint8 dataset: tables of any length (attributes stop at 64 KiB)."""
    return numpy.frombuffer(json.dumps(obj).encode(), dtype=numpy.uint8)


def _untext(array: numpy.ndarray) -> Any:
    return json.loads(numpy.asarray(array, dtype=numpy.uint8).tobytes().decode())


# -- writing --------------------------------------------------------------------------------

def part_bytes(held: Iterable[Held]) -> int:
    """At most the bytes :func:`write_part` writes for ``held`` (each piece and its runs),
    without reading them. Not collective."""
    held = [h for h in held if h.count]
    return storage.hdf5_bytes(sum(h.count * h.dtype.itemsize + h.runs.nbytes for h in held),
                              2 * len(held))


def write_part(path: str, step: int, rank: int, held: Iterable[Held]) -> list[list]:
    """Write this rank's pieces (the records it owns) to ``path`` atomically; return
    their index rows ``[key, dataset, count, crc, first, last]``. Not collective."""
    h5py = ckpt._h5py()
    rows: list[list] = []
    tmp = path + ".tmp"
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(format_version=SHARDED_VERSION, kind="part", step=int(step),
                           rank=int(rank))
            for h in held:
                values = h.read() if h.owner and h.count else None
                if values is None:
                    continue
                n = str(len(rows))
                # bfloat16 as its bits (checkpoint_file.stored); the index keeps its name
                data, _ = ckpt.stored(numpy.ascontiguousarray(as_numpy(values)).reshape(-1))
                assert data.size == h.count, (h.key, data.size, h.count)
                block = max(1, BLOCK_BYTES // data.itemsize)
                crcs = [zlib.crc32(data[i:i + block]) for i in range(0, data.size, block)]
                crc = 0
                for i in range(0, data.size, block):
                    crc = zlib.crc32(data[i:i + block], crc)
                ds = f.create_dataset(n, data=data)
                ds.attrs.update(key=json.dumps(list(h.key)), block=block, crc32=crc,
                                block_crc32=numpy.asarray(crcs, dtype=numpy.uint32))
                runs = f.create_dataset(n + ".runs", data=h.runs)
                runs.attrs["crc32"] = ckpt._crc(numpy.asarray(h.runs))
                first, last = h.bounds
                rows.append([list(h.key), int(n), int(data.size), crc, first, last])
                del data, values
            f.flush()
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return rows


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(directory: str, step: int, parts: Mapping[int, list[list]],
                keys: Mapping[Key, tuple[tuple, str]], ints: Mapping[Key, int], *,
                meta: Mapping[str, Any], rng: Any, sampler: Any, config: str, epoch: int,
                extra: Any) -> str:
    """Write the index of the sharded checkpoint of ``step`` (after its parts);
    return its path. Not collective: rank 0 calls it.

    Args:
        parts: by rank, the rows :func:`write_part` returned (ranks that wrote nothing
            are left out).
        keys: every tensor's full shape and dtype.
        ints: the optimizer's per-parameter integers.
        meta: ``order`` (the parameters' names in the optimizer's order), ``buffers``,
            ``optimizer`` (``{"step", "lr"}`` or None).
    """
    key_list = sorted(keys)
    key_id = {k: i for i, k in enumerate(key_list)}
    table, crcs = [], []
    for rank in sorted(parts):
        for key, dataset, count, crc, first, last in parts[rank]:
            table.append([key_id[Key(*key)], rank, dataset, count, first, last])
            crcs.append(crc)
    index = {
        "keys": _text([[*k, list(keys[k][0]), keys[k][1]] for k in key_list]),
        "ints": _text([[key_id.get(k, -1), *k, int(v)] for k, v in sorted(ints.items())]),
        "meta": _text({**meta, "parts": sorted(parts)}),
        "pieces": numpy.asarray(table, dtype=numpy.int64).reshape(-1, 6),
        "crc": numpy.asarray(crcs, dtype=numpy.uint32),
    }
    path = os.path.join(directory, ckpt.checkpoint_name(step))
    ckpt._write_file(path, step, epoch, config, {"rng": rng, "sampler": sampler,
                                                 "extra": extra or {}, "index": index},
                     version=SHARDED_VERSION)
    ckpt._fsync_dir(directory)
    return path


# -- reading: the parts as pieces -------------------------------------------------------------

class _PartPiece(Piece):
    def __init__(self, source: "ShardedSource", rank: int, dataset: int, count: int,
                 crc: int, first: int, last: int, key: Key) -> None:
        self.source, self.rank, self.name, self.count = source, rank, str(dataset), count
        self.crc, self.first, self.last, self.key = crc, first, last, key

    def _dataset(self, name: str) -> Any:
        f, path = self.source.part(self.rank)
        try:
            return f[name], path
        except KeyError:
            raise CheckpointError(f"checkpoint part {path} lacks piece {name} "
                                  f"({self.key.path()}) that the index names") from None

    def runs(self) -> numpy.ndarray:
        ds, path = self._dataset(self.name + ".runs")
        runs = ds[...]
        if ds.attrs.get("crc32") != ckpt._crc(runs):
            raise CheckpointError(f"checkpoint part {path} is corrupt: the runs of piece "
                                  f"{self.name} ({self.key.path()}) fail their checksum")
        return runs_array(runs)

    def copy_into(self, target: numpy.ndarray, segments: numpy.ndarray) -> None:
        ds, path = self._dataset(self.name)
        target, _ = ckpt.stored(target)  # a view: bfloat16 is stored as its bits
        block = int(ds.attrs["block"])
        crcs = ds.attrs["block_crc32"]
        if (int(ds.shape[0]) != self.count or int(ds.attrs["crc32"]) != self.crc
                or len(crcs) != -(-self.count // block)):
            raise CheckpointError(f"checkpoint part {path}: piece {self.name} "
                                  f"({self.key.path()}) is not the one the index names "
                                  "(element count or CRC-32 differ); a part of another save?")
        blocks = sorted({b for _, at, n in segments
                         for b in range(at // block, (at + n - 1) // block + 1)})
        for b in blocks:
            lo = b * block
            data = ds[lo:lo + block]
            if zlib.crc32(data) != int(crcs[b]):
                raise CheckpointError(
                    f"checkpoint part {path} is corrupt: piece {self.name} "
                    f"({self.key.path()}) elements {lo}-{lo + data.size - 1} fail their "
                    "checksum; resume from an earlier checkpoint")
            hi = lo + data.size
            for to, at, n in segments:
                x, y = max(at, lo), min(at + n, hi)
                if x < y:
                    target[to + x - at:to + y - at] = data[x - lo:y - lo]


class ShardedSource(Source):
    """A format-3 checkpoint: its index, and its parts opened as pieces are read."""

    def __init__(self, path: str, index: Mapping[str, Any]) -> None:
        self.path = path
        keys = _untext(index["keys"])
        key_list = [Key(*k[:3]) for k in keys]
        self.keys = {Key(*k[:3]): (tuple(k[3]), k[4]) for k in keys}
        self.ints = {Key(*row[1:4]): int(row[4]) for row in _untext(index["ints"])}
        self.meta = _untext(index["meta"])
        self.optimizer = self.meta.get("optimizer")
        self._pieces: dict[Key, list[Piece]] = {}
        for (k, rank, dataset, count, first, last), crc in zip(
                numpy.asarray(index["pieces"]).tolist(), numpy.asarray(index["crc"]).tolist()):
            key = key_list[k]
            self._pieces.setdefault(key, []).append(
                _PartPiece(self, rank, dataset, count, crc, first, last, key))
        self._files: dict[int, tuple[Any, str]] = {}

    def part_paths(self) -> list[str]:
        directory = os.path.dirname(self.path)
        step = int(os.path.basename(self.path)[len("checkpoint-"):-len(".h5")])
        return [os.path.join(directory, part_name(step, r)) for r in self.meta["parts"]]

    def part(self, rank: int) -> tuple[Any, str]:
        if rank not in self._files:
            path = os.path.join(os.path.dirname(self.path),
                                f"{os.path.basename(self.path)}.part-{rank:05d}")
            if not os.path.isfile(path):
                raise CheckpointError(f"checkpoint {self.path} lacks the part of rank {rank}, "
                                      f"{path}; restore it, or resume from an earlier one")
            try:
                self._files[rank] = (ckpt._h5py().File(path, "r", locking=False), path)
            except OSError as e:
                raise CheckpointError(f"checkpoint part {path} cannot be opened: it is "
                                      f"truncated or corrupt ({e})") from None
        return self._files[rank]

    def pieces(self, key: Key) -> list[Piece]:
        return self._pieces.get(key, [])

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files = {}


def full_trees(source: ShardedSource, optimizer: bool = True) -> tuple[dict, dict]:
    """The single-rank model (and optimizer state, in its own layout over the
    parameters' order) of a sharded checkpoint, as values made when read: callables
    (one tensor at a time while a consolidated file is written) -- call each for the
    array."""
    order, buffers = source.meta["order"], source.meta.get("buffers", [])
    model = {n: (lambda n=n: assemble(source, Key("model", n))) for n in order + buffers
             if Key("model", n) in source.keys}
    state: dict[str, Any] = {}
    if optimizer and source.optimizer is not None:
        state.update(step=int(source.optimizer["step"]), lr=float(source.optimizer["lr"]))
        for i, name in enumerate(order):
            for key in sorted(k for k in source.keys
                              if k.group == "optimizer" and k.name == name):
                state[f"state.{i}.{key.array}"] = lambda key=key: assemble(source, key)
            for key, value in sorted(source.ints.items()):
                if key.name == name:
                    state[f"state.{i}.{key.array}"] = int(value)
    return model, state


def read_state(state: Any, what: str) -> None:
    """Finish :func:`~mpidl.train.checkpoint.load_checkpoint` of a sharded checkpoint:
    check that every part it names exists, then put the whole model (``what`` "model"
    or "full") and optimizer state ("full") in ``state``, as a format-2 file has them.
    Not collective; only ``mpidl checkpoint consolidate``, eval and predict ask for
    the whole state."""
    source = ShardedSource(state.path, state.index)
    missing = [p for p in source.part_paths() if not os.path.isfile(p)]
    if missing:
        raise CheckpointError(f"checkpoint {state.path} lacks {len(missing)} of its parts "
                              f"({', '.join(missing[:3])}); restore them, or resume from "
                              "an earlier checkpoint")
    if what == "none":
        return
    with source:
        model, optimizer = full_trees(source, optimizer=what == "full")
        state.model = {name: make() for name, make in model.items()}
        state.optimizer = {k: v() if callable(v) else v for k, v in optimizer.items()}


__all__ = ["SHARDED_VERSION", "part_name", "part_bytes", "write_part", "write_index", "ShardedSource",
           "full_trees", "read_state"]
