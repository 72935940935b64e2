"""One shard file and its manifest entry, written: the storage settings, the HDF5 file,
the split's manifest. :mod:`mpidl.data.writer` (one process) and
:mod:`mpidl.data.parallel` (each rank its own shards) write datasets with them.

A shard is ``shard-NNNNN.h5``: one HDF5 dataset per feature, contiguous and unfiltered
by default (the fastest to read: the loader copies out of a memory map at its offset),
or chunked with the byte-shuffle filter, ``fletcher32`` and lzf or gzip. Its attributes
name the dataset, the split, its index and first sample (:mod:`mpidl.data.format`).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping

import numpy

from mpidl.data.format import (
    FORMAT_VERSION,
    SHARD_FORMAT,
    Feature,
    Manifest,
    Shard,
    sha256_file,
    shard_name,
)
from mpidl.data.sampler import DEFAULT_BLOCK_SIZE
from mpidl.storage import check_room, hdf5_bytes, write_error

SHARD_BYTES = 256 << 20  # default shard size: the study's 256 MiB - 2 GiB range, low end
CHUNK_BYTES = 256 << 10  # chunk size when compressed: small enough for block reads
COMPRESSIONS = (None, "gzip", "lzf")
def writer_info() -> dict[str, str]:
    import h5py

    from mpidl import __version__

    return {"mpidl": __version__, "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version}


def check_options(rows_per_shard: int | None, compression: str | None = None,
                   compression_opts: Any = None) -> dict[str, Any]:
    """Raise ValueError for bad writing options; return the shards' storage settings.

    Called before anything is written.
    """
    if rows_per_shard is not None and rows_per_shard < 1:
        raise ValueError(f"rows_per_shard {rows_per_shard} must be >= 1")
    return storage_settings(compression, compression_opts)


def storage_settings(compression: str | None, compression_opts: Any) -> dict[str, Any]:
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression {compression!r} is not one of {COMPRESSIONS}")
    if compression is None:
        return {"layout": "contiguous"}
    if compression == "gzip" and compression_opts is None:
        compression_opts = 4
    return {
        "layout": "chunked",
        "compression": compression,
        "compression_opts": compression_opts,
        "chunk_bytes": CHUNK_BYTES,
        "shuffle": True,
        "fletcher32": True,
    }


def chunk_rows(a: numpy.ndarray) -> int:
    """Rows per HDF5 chunk of a compressed feature: about :data:`CHUNK_BYTES`, and a
    multiple or a divisor of the sampler's default block (64 rows), so that a block read
    from a shard whose first row is a multiple of it decompresses one chunk (or whole
    chunks), not the two it straddles: 83-row chunks of MNIST-sized rows made each
    64-row read decompress 1.8 chunks on average."""
    rows = max(1, CHUNK_BYTES // max(1, a[:1].nbytes))
    if rows >= DEFAULT_BLOCK_SIZE:
        return rows // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
    return 1 << (rows.bit_length() - 1)


def write_file(
    path: str, arrays: Mapping[str, numpy.ndarray], storage: dict[str, Any], attrs: dict[str, Any]
) -> None:
    import h5py

    if storage["layout"] == "contiguous":  # compressed files are smaller: no size known
        check_room(path, hdf5_bytes(sum(a.nbytes for a in arrays.values()), len(arrays)))
    try:
        with h5py.File(path, "w", locking=False) as f:
            for k, v in attrs.items():
                f.attrs[k] = v
            for name, a in arrays.items():
                if storage["layout"] == "contiguous":
                    f.create_dataset(name, data=a)  # contiguous: no chunks, no filters
                    continue
                chunk = (max(1, min(len(a), chunk_rows(a))), *a.shape[1:])
                f.create_dataset(
                    name,
                    data=a,
                    chunks=chunk,
                    compression=storage["compression"],
                    compression_opts=storage["compression_opts"],
                    shuffle=True,
                    fletcher32=True,
                )
    except (OSError, RuntimeError) as e:  # HDF5 raises either when a write fails
        raise write_error(e, path) from e


def shard_rows(arrays: Mapping[str, numpy.ndarray], rows_per_shard: int | None) -> int:
    """Rows per shard: ``rows_per_shard``, or about :data:`SHARD_BYTES` of ``arrays``'
    rows (their dtypes and per-sample shapes decide, not their row counts)."""
    row_bytes = sum(v.dtype.itemsize * int(numpy.prod(v.shape[1:])) for v in arrays.values())
    rows = SHARD_BYTES // max(1, row_bytes)
    # a multiple of the sampler's block: whole blocks (and chunks: chunk_rows) per shard
    return rows_per_shard or max(1, rows // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE or rows)


def write_rows(directory: str, arrays: Mapping[str, numpy.ndarray], storage: dict[str, Any],
               per: int, *, split: str, dataset_id: str, first_shard: int, num_shards: int,
               first_sample: int, writer: dict[str, str]) -> list[Shard]:
    """Write ``arrays``' rows as shards of ``per`` rows, the first named ``first_shard``
    and holding sample ``first_sample`` of the split's ``num_shards`` shards; their
    manifest entries (a rank of a parallel write writes its rows this way)."""
    n = len(next(iter(arrays.values())))
    shards = []
    for i, a in enumerate(range(0, n, per)):
        b = min(a + per, n)
        name = shard_name(first_shard + i)
        path = os.path.join(directory, name)
        attrs = {
            "format": SHARD_FORMAT,
            "format_version": FORMAT_VERSION,
            "dataset_id": dataset_id,
            "split": split,
            "shard_index": first_shard + i,
            "num_shards": num_shards,
            "rows": b - a,
            "first_sample": first_sample + a,
            "writer": json.dumps(writer),
        }
        write_file(path, {k: v[a:b] for k, v in arrays.items()}, storage, attrs)
        shards.append(Shard(name, b - a, os.path.getsize(path), sha256_file(path)))
    return shards


def make_manifest(arrays: Mapping[str, numpy.ndarray], shards: list[Shard],
                  storage: dict[str, Any], *, split: str, dataset_id: str,
                  labels: str | None, num_classes: int | None, metadata: Mapping[str, Any],
                  writer: dict[str, str], created: str | None = None) -> Manifest:
    """The manifest of a split of ``arrays``' features (any rows of them: only dtypes and
    per-sample shapes are read) stored in ``shards``."""
    features = {k: Feature(k, v.dtype, tuple(v.shape[1:])) for k, v in arrays.items()}
    return Manifest(
        features=features,
        shards=shards,
        dataset_id=dataset_id,
        split=split,
        storage=storage,
        labels=None if labels is None else {"feature": labels, "num_classes": int(num_classes)},
        metadata=dict(metadata),
        writer=writer,
        created=created or created_now(),
    )


def created_now() -> str:
    """A manifest's ``created`` time: now, in UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
