"""One checkpoint-format HDF5 file: trees of arrays and plain values, CRC-32s, written
atomically. :mod:`mpidl.train.checkpoint` (replicated files) and
:mod:`mpidl.train.sharded` (an index and its parts) build on it.

A state dict is a tree: a ``dict`` is a group; an array (numpy or cupy) or a numpy scalar
is a dataset (exact dtype and shape); Python ``int``/``float``/``bool``/``str``/``None``
and lists of them are kept together in the group's ``__json__`` attribute. JSON keeps
Python ints of any size exactly, which is what a PCG64 ``bit_generator.state`` holds
(128-bit ``state`` and ``inc``), and ``repr``-exact floats, so RNG states round-trip bit
for bit. Tuples come back as lists. Keys are strings (ints are turned into strings); a
``/`` in a key is an error (HDF5 would make it a path), dots are fine. A value may also
be a callable that returns one of these: it is called when written, so that a large
state is written one array at a time.

Integrity (format version 2 on): every dataset carries the CRC-32 of its bytes
(``__crc32__``), every group's plain values the CRC-32 of their JSON
(``__json_crc32__``), and the root the CRC-32 of step, epoch and config; a read checks
them all, so flipped bytes inside the raw data (which HDF5 reads without complaint) are
a :class:`CheckpointError` naming the file and the item. CRC-32 (zlib) runs at several
GB/s, a small cost next to writing the bytes. Version 1 files (no checksums) still load.

The write is atomic: ``NAME.tmp`` in the same directory, flushed and fsynced, then
``os.replace`` and an fsync of the directory. A job killed half-way leaves a ``.tmp``
file, which the listings ignore.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from typing import Any, Mapping

import numpy

from mpidl import __version__, storage
from mpidl.backend import as_numpy, bfloat16

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2, 3)  # 1: before checksums; 3: sharded (mpidl.train.sharded)
STATES = ("full", "model", "none")  # what load_checkpoint reads of the model and optimizer
_GROUPS = ("model", "optimizer", "rng", "sampler", "extra")
_JSON_ATTR = "__json__"
_SCALAR_ATTR = "__scalar__"
_ORDER_ATTR = "__order__"
_CRC_ATTR = "__crc32__"
_JSON_CRC_ATTR = "__json_crc32__"
_DTYPE_ATTR = "__dtype__"


def _crc(data: bytes | numpy.ndarray) -> int:
    if isinstance(data, numpy.ndarray):
        data = numpy.ascontiguousarray(data).view(numpy.uint8).reshape(-1) if data.size else b""
    return zlib.crc32(data)


def _root_crc(step: int, epoch: int, config: str) -> int:
    return zlib.crc32(json.dumps([int(step), int(epoch), str(config)]).encode())


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: truncated, corrupt, or of another format version."""


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at ``step``: ``checkpoint-00001200.h5``."""
    return f"checkpoint-{int(step):08d}.h5"


def _h5py():
    # Here: h5py loads when a file is read or written, not with mpidl.train (which
    # `mpidl train` imports before its signal handlers are in place).
    import h5py

    return h5py


# -- how arrays are stored: the one rule for every writer and reader of checkpoints -------

def stored(array: numpy.ndarray) -> tuple[numpy.ndarray, str | None]:
    """``array`` as HDF5 stores it, and the dtype name to keep beside it (None: the
    stored dtype is the array's own).

    HDF5 has no bfloat16: h5py writes one as an opaque ``|V2`` that it reads back as raw
    bytes, which no loader takes for a bfloat16 tensor. Its bits are stored as uint16
    and its name kept (``__dtype__`` here, the index's dtype in a sharded checkpoint);
    :func:`restored` undoes it. float16 and every other NumPy dtype HDF5 has are stored
    as they are. The bytes, and so the CRC-32, are the array's own either way.
    """
    if array.dtype.name == "bfloat16":
        return array.view(numpy.uint16), "bfloat16"
    return array, None


def restored(array: numpy.ndarray, name: Any = None) -> numpy.ndarray:
    """An array read from HDF5 as the tensor it stores: ``name`` is the dtype
    :func:`stored` kept (None if none)."""
    return array.view(bfloat16()) if _holds_bfloat16(array.dtype, name) else array


def restored_dtype(dataset: Any) -> numpy.dtype:
    """The dtype :func:`restored` gives an HDF5 dataset's array, without reading it."""
    if _holds_bfloat16(dataset.dtype, dataset.attrs.get(_DTYPE_ATTR)):
        return numpy.dtype(bfloat16())
    return dataset.dtype


def _holds_bfloat16(dtype: numpy.dtype, name: Any) -> bool:
    # An opaque 2-byte array with no name is a bfloat16 written before the rule (h5py's
    # |V2 of mpidl <= a8b384f): the same bits, so it loads.
    if name is not None:
        return str(name) == "bfloat16"
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.names is None


# -- writing ----------------------------------------------------------------------------

def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _write_tree(group: Any, tree: Mapping[Any, Any], where: str) -> None:
    plain: dict[str, Any] = {}
    for key, value in tree.items():
        key = str(key)
        if "/" in key or key in ("", "."):
            raise ValueError(f"checkpoint key {where}/{key!r} is not a valid HDF5 name "
                             "(no '/', not empty); rename it")
        if callable(value):  # made when written: one large array at a time
            value = value()
        if isinstance(value, Mapping):
            _write_tree(group.create_group(key), value, f"{where}/{key}")
        elif _is_array(value):
            # A NumPy scalar as it is (as_numpy would ask a bfloat16 one for a buffer).
            array, name = stored(numpy.asarray(value) if isinstance(value, numpy.generic)
                                 else as_numpy(value))
            dataset = group.create_dataset(key, data=array)
            dataset.attrs[_CRC_ATTR] = _crc(array)
            if name is not None:
                dataset.attrs[_DTYPE_ATTR] = name
            if isinstance(value, numpy.generic):
                dataset.attrs[_SCALAR_ATTR] = True
        else:
            plain[key] = _plain(value, f"{where}/{key}")
    if plain:
        text = json.dumps(plain)
        group.attrs[_JSON_ATTR] = text
        group.attrs[_JSON_CRC_ATTR] = _crc(text.encode())
    # HDF5 lists members alphabetically; keep the caller's order (a model's parameter
    # order is the order of its gradient buckets).
    group.attrs[_ORDER_ATTR] = json.dumps([str(k) for k in tree])


def _plain(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise TypeError(f"checkpoint value at {where} is a {type(value).__name__}; use arrays, "
                    "numbers, strings, None, lists or dicts (no pickle in checkpoints)")


def _fsync_dir(directory: str) -> None:
    # The rename is durable only once the directory entry is on disk (POSIX).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file(path: str, step: int, epoch: int, config: str,
                trees: Mapping[str, Mapping[str, Any]], version: int = FORMAT_VERSION) -> None:
    """One checkpoint-format file, atomically: ``PATH.tmp``, fsync, rename."""
    h5py = _h5py()
    tmp = path + ".tmp"
    # Before HDF5 starts: a full disk met inside it may crash the process (mpidl.storage).
    storage.check_room(tmp, _stored_bytes(trees))
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format_version"] = version
            f.attrs["step"] = int(step)
            f.attrs["epoch"] = int(epoch)
            f.attrs["config"] = config
            f.attrs["created"] = time.time()
            f.attrs["mpidl_version"] = _mpidl_version()
            f.attrs[_CRC_ATTR] = _root_crc(step, epoch, config)
            for name, tree in trees.items():
                _write_tree(f.create_group(name), tree, name)
            f.flush()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _stored_bytes(trees: Mapping[str, Any]) -> int:
    """At most the bytes of a file of ``trees`` (a value made when written counts as an
    empty dataset: its size is not known before)."""
    data = datasets = 0
    stack = list(trees.values())
    while stack:
        tree = stack.pop()
        for value in tree.values():
            if isinstance(value, Mapping):
                stack.append(value)
            elif _is_array(value) or callable(value):
                datasets += 1
                data += int(value.nbytes) if _is_array(value) else 0
    return storage.hdf5_bytes(data, datasets)


def _mpidl_version() -> str:
    return __version__


# -- reading ----------------------------------------------------------------------------

class _Corrupt(Exception):
    """An item of the file failed its checksum (turned into CheckpointError by the loader)."""


def _read_tree(group: Any, verify: bool, arrays: bool | None = True) -> dict[str, Any]:
    """A group as a tree. ``arrays``: True reads the datasets; None reads and checks
    them one at a time, keeping none; False skips them."""
    out: dict[str, Any] = {}
    if _JSON_ATTR in group.attrs:
        text = group.attrs[_JSON_ATTR]
        if verify and group.attrs.get(_JSON_CRC_ATTR) != _crc(str(text).encode()):
            raise _Corrupt(f"the plain values of {group.name} fail their checksum")
        try:
            out.update(json.loads(text))
        except ValueError:
            raise _Corrupt(f"the plain values of {group.name} are not valid JSON") from None
    for key, item in group.items():
        if hasattr(item, "keys"):
            out[key] = _read_tree(item, verify, arrays)
            continue
        if arrays is False:
            continue
        array = restored(item[...], item.attrs.get(_DTYPE_ATTR))  # 0-d stay arrays
        if verify and item.attrs.get(_CRC_ATTR) != _crc(array):
            raise _Corrupt(f"{item.name} (shape {array.shape}, {array.dtype}) fails its "
                           "checksum")
        if arrays:
            out[key] = array[()] if item.attrs.get(_SCALAR_ATTR, False) else array
        del array
    if _ORDER_ATTR in group.attrs:
        order = json.loads(group.attrs[_ORDER_ATTR])
        out = ({k: out[k] for k in order if k in out}
               | {k: v for k, v in out.items() if k not in order})
    return out


def _attr(f: Any, name: str, path: str) -> Any:
    if name not in f.attrs:
        raise CheckpointError(f"checkpoint {path} has no attribute {name!r}; not an mpidl "
                              "checkpoint, or written by an incompatible version")
    value = f.attrs[name]
    return value.item() if isinstance(value, numpy.generic) else value
