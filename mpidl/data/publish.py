"""Put newly written splits in place of the old ones only once they are complete.

``mpidl shard --force`` used to delete the old dataset and then write the new one: a
full disk half-way left a partial shard, no manifest and nothing to train on.
:func:`publish_splits` writes the new splits into a temporary directory beside them (in
the same parent, so on the same filesystem, where a move is a rename), and only when
every split is complete moves the old dataset's files aside (each manifest first, so a
half-replaced directory never looks like a dataset), moves the new ones in (each
manifest last) and removes the old ones. A failure while writing removes the partial
new dataset and leaves the old one as it was; the error names the file that could not
be written and why ("No space left on device").

Only a split's own files move (``manifest.json``, ``shard-NNNNN.h5``): anything else a
user keeps in the dataset or split directories stays where it is.
"""

from __future__ import annotations

import errno as errno_module
import os
import re
import shutil
import tempfile
from typing import Callable, Mapping, Sequence

from mpidl.data.format import MANIFEST_NAME, DataError, Manifest

_SHARD_RE = re.compile(r"shard-\d{5}\.h5")


class StorageError(DataError):
    """The new dataset could not be written or moved into place (a full disk, a quota, a
    file-size limit): a failure of the storage, not of the input (``mpidl shard`` exits
    1 for it, 2 for bad input: docs/exit-status.md)."""
_FIXES = {
    errno_module.ENOSPC: "free space on that filesystem (`df {parent}`) or write to another "
                         "OUT_DIR",
    errno_module.EDQUOT: "free space within your quota (`quota`, `lfs quota`) or write to "
                         "another OUT_DIR",
    errno_module.EFBIG: "raise the file-size limit (`ulimit -f`) or write smaller shards "
                        "(--rows-per-shard)",
}


def dataset_files(directory: str) -> list[str]:
    """The names of the files of the split at ``directory``: the manifest (if any) first,
    then the shards in order; ``[]`` when there is no such directory."""
    if not os.path.isdir(directory):
        return []
    names = os.listdir(directory)
    shards = sorted(f for f in names if _SHARD_RE.fullmatch(f))
    return ([MANIFEST_NAME] if MANIFEST_NAME in names else []) + shards


def _move(names: Sequence[str], source: str, target: str) -> None:
    os.makedirs(target, exist_ok=True)
    for name in names:
        os.rename(os.path.join(source, name), os.path.join(target, name))


def publish_splits(
    parent: str,
    writers: Mapping[str, Callable[[str], Manifest]],
    *,
    overwrite: bool,
    replaces: Sequence[str],
) -> dict[str, Manifest]:
    """Write the splits ``writers`` names into ``parent``, replacing those of ``replaces``.

    Args:
        parent: the dataset directory (``OUT_DIR``), created if needed.
        writers: split name -> a function that writes that split into the (new, empty)
            directory it is given and returns its manifest.
        overwrite: whether an existing dataset in one of ``replaces`` may be replaced.
        replaces: the split directories whose old dataset files go, e.g. ``("train",
            "test")``: an old test split must not outlive the train split it belongs to.

    Raises:
        DataError: a split in ``replaces`` holds a dataset and ``overwrite`` is False
            (before anything is written).
        StorageError: a write failed (the old dataset unchanged).
    """
    old = old_files(parent, overwrite, replaces)
    new = stage(parent)
    try:
        manifests = {name: write(os.path.join(new, name)) for name, write in writers.items()}
    except OSError as e:
        raise storage_error(e, parent, new, old) from e
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    install(parent, new, list(manifests), old)
    return manifests


def old_files(parent: str, overwrite: bool, replaces: Sequence[str]) -> dict[str, list[str]]:
    """The files of the old dataset's splits ``replaces`` (split -> names); DataError if
    one holds a dataset and ``overwrite`` is False."""
    old = {name: dataset_files(os.path.join(parent, name)) for name in replaces}
    held = [name for name, files in old.items() if files]
    if held and not overwrite:
        where = os.path.join(parent, held[0])
        raise DataError(
            f"{where}: already holds a dataset ({old[held[0]][0]}, ...); "
            "choose another directory or overwrite it (overwrite=True, `--force`)"
        )
    return old


def stage(parent: str) -> str:
    """A new, empty directory beside the dataset in ``parent`` to write the new one into."""
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".mpidl-shard-new-", dir=parent)


def storage_error(e: OSError, parent: str, new: str, old: Mapping[str, list[str]]
                  ) -> StorageError:
    """Remove the partial new dataset ``new``; the error to raise for the failed write
    ``e``, naming the file (as it would be in ``parent``), the reason and the fix."""
    shutil.rmtree(new, ignore_errors=True)
    failed = os.path.join(parent, os.path.relpath(e.filename, new)) if e.filename else parent
    state = ("the dataset already there is unchanged" if any(old.values())
             else "no dataset was there")
    fix = _FIXES.get(e.errno, "write to another OUT_DIR").format(parent=parent)
    return StorageError(
        f"{failed}: cannot write the new dataset ({e.strerror or e}); {state} and the "
        f"partial new one was removed: {fix}",
        [(failed, str(e.strerror or e))],
    )


def install(parent: str, new: str, names: Sequence[str], old: Mapping[str, list[str]]) -> None:
    """Move the complete splits ``names`` from ``new`` into ``parent`` in place of the
    old dataset's files ``old`` (see the module docstring for the order)."""
    held = [name for name, files in old.items() if files]
    aside = tempfile.mkdtemp(prefix=".mpidl-shard-old-", dir=parent)
    try:
        for name in held:
            _move(old[name], os.path.join(parent, name), os.path.join(aside, name))
        for name in names:
            files = dataset_files(os.path.join(new, name))
            _move(files[1:] + files[:1], os.path.join(new, name), os.path.join(parent, name))
        for name in set(held) - set(names):  # an old split the new dataset lacks
            if not os.listdir(os.path.join(parent, name)):
                os.rmdir(os.path.join(parent, name))
    except OSError as e:  # a rename within one directory tree: should not happen
        raise StorageError(
            f"{parent}: cannot move the new dataset into place ({e}); the old dataset's "
            f"files are in {aside}, the new one's in {new}: move them back by hand"
        ) from e
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(new, ignore_errors=True)
