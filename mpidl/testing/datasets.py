"""Datasets for tests: damage a written one the way a hand-edited or corrupted one looks,
or take its test rows as a user would give them to ``mpidl predict``.

``edit_manifest`` changes a field of a split's manifest; after a test changed a shard's
contents, ``resync_shard`` makes the manifest's size and checksum of that shard match the
file again, so that only the contents differ from what the manifest promises (what a
writer bug, or a careful forger, would leave). Neither is collective: on several ranks,
let rank 0 edit and then ``comm.barrier()``. ``write_test_rows`` writes a test split's
inputs to an ``.npz``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable


def edit_manifest(split: str | os.PathLike, change: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``change`` to the decoded ``manifest.json`` of ``split`` and write it back."""
    path = os.path.join(split, "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    change(manifest)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def resync_shard(split: str | os.PathLike, index: int) -> str:
    """Set the manifest's ``bytes`` and ``sha256`` of shard ``index`` to the file's own;
    returns the shard's path."""
    from mpidl.data.format import sha256_file

    paths = []

    def update(manifest: dict[str, Any]) -> None:
        entry = manifest["shards"][index]
        paths.append(os.path.join(split, entry["file"]))
        entry.update(bytes=os.path.getsize(paths[0]), sha256=sha256_file(paths[0]))

    edit_manifest(split, update)
    return paths[0]


def write_test_rows(data_dir: str | os.PathLike, path: str | os.PathLike) -> tuple[Any, Any]:
    """Write the inputs ``x`` of ``data_dir``'s test split, in order, to the ``.npz`` at
    ``path`` (what ``mpidl predict`` reads); returns the split and its sample ids, to
    read the truth from (``split.read("y", ids)``)."""
    import numpy

    from mpidl.data import ShardedDataset

    test = ShardedDataset(os.path.join(data_dir, "test"))
    ids = numpy.arange(len(test))
    numpy.savez(path, x=test.read("x", ids))
    return test, ids
