"""The safetensors format, written and read by hand, one tensor at a time.

The published format (huggingface/safetensors, "Format"): an 8-byte little-endian header
length N, N bytes of JSON header, then the raw little-endian bytes of every tensor. The
header maps each name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
into the byte buffer after the header, in order, without gaps) and may hold
``"__metadata__"``, a map of strings to strings.

Why by hand and not the ``safetensors`` package: its writers take every tensor at once
(a dict in memory), where :func:`write` takes tensors as callables made one at a time,
so exporting a sharded checkpoint holds one tensor, never the model. The header is known
before any tensor is made (shapes and dtypes come from the checkpoint's index). The
tests read every file this writes with the ``safetensors`` package itself.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy

from mpidl.backend import named_dtype

# safetensors' dtype names <-> NumPy's (bfloat16 through ml_dtypes, as mpidl's bf16)
_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
          "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64",
          "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}
_NAMES = {code: name for name, code in _CODES.items()}
# A header larger than this is not a header: a file of another kind, or corrupt (the
# reference implementation refuses headers over 100 MB too).
MAX_HEADER = 100_000_000


def _host_order() -> None:
    # The format is little-endian; NumPy's arrays are in the host's order. Every machine
    # mpidl runs on (x86-64, AArch64, POWER9 in LE mode) is little-endian: say so if not.
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors files are little-endian; this host is "
                                  f"{sys.byteorder}-endian")


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file; the message names it."""


def code(dtype: Any) -> str:
    """safetensors' name of a NumPy dtype (``"F32"``); ValueError for one it lacks."""
    name = numpy.dtype(dtype).name
    if name not in _CODES:
        raise ValueError(f"safetensors has no dtype for {name}; cast the tensor first")
    return _CODES[name]


def header(tensors: Iterable[tuple[str, tuple[int, ...], Any]],
           metadata: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The JSON header of ``(name, shape, dtype)`` in write order, with ``metadata``."""
    head: dict[str, Any] = {}
    if metadata:
        head["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, shape, dtype in tensors:
        if name in head:
            raise ValueError(f"tensor {name!r} given twice")
        size = int(numpy.prod(shape, dtype=numpy.int64)) * numpy.dtype(dtype).itemsize
        head[name] = {"dtype": code(dtype), "shape": [int(d) for d in shape],
                      "data_offsets": [offset, offset + size]}
        offset += size
    return head


def write(path: str | os.PathLike, tensors: Iterable[tuple[str, tuple[int, ...], Any,
                                                           Callable[[], Any]]],
          metadata: Mapping[str, str] | None = None) -> int:
    """Write ``(name, shape, dtype, make)`` as a safetensors file at ``path``; return
    its size. ``make()`` is called once per tensor, in order, and its array dropped
    before the next (peak memory: one tensor). The caller makes the file atomic."""
    _host_order()
    tensors = list(tensors)
    head = header(((n, s, d) for n, s, d, _ in tensors), metadata)
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # align the data to 8 bytes, as the reference does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, dtype, make in tensors:
            array = numpy.asarray(make())
            want = numpy.dtype(dtype)
            if tuple(array.shape) != tuple(shape) or array.dtype != want:
                raise ValueError(f"tensor {name!r} is {array.dtype} {array.shape}; its header "
                                 f"says {want} {tuple(shape)}")
            f.write(numpy.ascontiguousarray(array).tobytes())  # little-endian: _host_order
            del array
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str], int]:
    """``(tensors, metadata, data_start)`` of the safetensors file at ``path``:
    name -> ``{"dtype", "shape", "data_offsets"}``, checked against the file's size."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path} is not a safetensors file: {size} bytes")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER, size - 8):
            raise SafetensorsError(f"{path} is not a safetensors file: its first 8 bytes "
                                   f"give a header of {n} bytes, and the file has {size}")
        try:
            head = json.loads(f.read(n).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path} is not a safetensors file: its header is not "
                                   f"JSON ({e})") from None
    if not isinstance(head, dict):
        raise SafetensorsError(f"{path}: its header is not a JSON object")
    metadata = head.pop("__metadata__", None) or {}
    end = 0
    for name, entry in sorted(head.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]
                              if isinstance(kv[1], dict) else 0):
        try:
            begin, stop = entry["data_offsets"]
            dtype = numpy.dtype(named_dtype(_NAMES[entry["dtype"]]))
            count = int(numpy.prod(entry["shape"], dtype=numpy.int64))
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{path}: tensor {name!r} has a bad entry {entry} "
                                   f"({e!r})") from None
        if begin != end or stop - begin != count * dtype.itemsize:
            raise SafetensorsError(f"{path}: tensor {name!r} spans bytes [{begin}, {stop}) "
                                   f"for {count} {dtype.name} values after a tensor ending at "
                                   f"{end}; the file is corrupt")
        end = stop
    if 8 + n + end != size:
        raise SafetensorsError(f"{path}: its tensors end at byte {8 + n + end}, the file has "
                               f"{size}; it is truncated or has trailing bytes")
    return head, dict(metadata), 8 + n


def read(path: str | os.PathLike) -> Iterator[tuple[str, numpy.ndarray]]:
    """``(name, array)`` of every tensor in the file's order, one read at a time."""
    _host_order()
    head, _, start = read_header(path)
    with open(path, "rb") as f:
        for name, entry in sorted(head.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, stop = entry["data_offsets"]
            dtype = numpy.dtype(named_dtype(_NAMES[entry["dtype"]]))
            f.seek(start + begin)
            yield name, numpy.frombuffer(f.read(stop - begin), dtype=dtype).reshape(
                entry["shape"]).copy()


def load(path: str | os.PathLike) -> dict[str, numpy.ndarray]:
    """Every tensor of the file, by name."""
    return dict(read(path))


__all__ = ["SafetensorsError", "code", "header", "write", "read_header", "read", "load"]
