"""Read the inputs ``mpidl shard`` accepts: a text folder tree, ``.npz``, HDF5 (and
CSV/TSV: :mod:`mpidl.data.csv_source`, whose readers are re-exported here).

Each reader returns plain Python/NumPy data split into ``{"train": ..., "test": ...}``
when the input already has splits, and raises :class:`~mpidl.data.format.DataError`
naming the file (and line) for bad input. Nothing is skipped silently, except blank
lines of a CSV file, which hold no record.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy

from mpidl.comm.base import split_counts
from mpidl.data.csv_source import (  # noqa: F401 - re-exported: every input reader here
    CsvLabels,
    Span,
    csv_dialect,
    encode_csv_labels,
    read_csv,
    read_csv_arrays,
    read_csv_columns,
)
from mpidl.data.format import DataError

def _class_dirs(root: str) -> list[str]:
    return sorted(
        d
        for d in os.listdir(root)
        if os.path.isdir(os.path.join(root, d)) and not d.startswith(".")
    )


def _class_files(folder: str) -> list[str]:
    names = sorted(
        f
        for f in os.listdir(folder)
        if not f.startswith(".") and os.path.isfile(os.path.join(folder, f))
    )
    if not names:
        raise DataError(f"{folder}: class folder holds no text files")
    return [os.path.join(folder, name) for name in names]


def read_texts(paths: Sequence[str]) -> list[str]:
    """The UTF-8 texts of the files ``paths``; DataError naming the first that is not."""
    texts = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not valid UTF-8 text ({e})") from e
    return texts


def list_folder(
    root: str, classes: list[str] | None = None
) -> tuple[dict[str, tuple[list[str], list[str]]], list[str]]:
    """The files :func:`read_folder` reads, in its order: ``({split: (paths, labels)},
    classes)`` (what rank 0 lists for every rank under ``mpiexec``)."""
    if not os.path.isdir(root):
        raise DataError(f"{root}: no such folder")
    has_splits = all(os.path.isdir(os.path.join(root, s)) for s in ("train", "test"))
    split_dirs = (
        {s: os.path.join(root, s) for s in ("train", "test")} if has_splits else {"train": root}
    )
    if classes is None:
        found = [set(_class_dirs(d)) for d in split_dirs.values()]
        classes = sorted(set.intersection(*found))
        if len(classes) < 2:
            raise DataError(
                f"{root}: found class folders {sorted(found[0])}; need at least 2 "
                "(one sub-folder of text files per class"
                + (", present in both train/ and test/)" if has_splits else ")")
            )
    out = {}
    for split, d in split_dirs.items():
        paths, labels = [], []
        for c in classes:
            folder = os.path.join(d, c)
            if not os.path.isdir(folder):
                raise DataError(f"{folder}: class folder {c!r} is missing")
            files = _class_files(folder)
            paths += files
            labels += [c] * len(files)
        out[split] = (paths, labels)
    return out, list(classes)


def read_folder(
    root: str, classes: list[str] | None = None
) -> tuple[dict[str, tuple[list[str], list[str]]], list[str]]:
    """Texts from one sub-folder of text files per class.

    Two layouts: ``root/train/<class>/*.txt`` and ``root/test/<class>/*.txt`` (the
    ``aclImdb`` layout: classes are the folders present in both splits, so ``train/unsup``
    is left out), or ``root/<class>/*`` with no splits. Files are read in name order
    (hidden files are ignored) as UTF-8.

    Returns:
        ``({split: (texts, labels)}, classes)``.

    Raises:
        DataError: no such folder, no class folders, a named class missing, an empty class
            folder or a file that is not UTF-8.
    """
    listed, classes = list_folder(root, classes)
    return {split: (read_texts(paths), labels)
            for split, (paths, labels) in listed.items()}, classes


def _share(n: int, part: tuple[int, int] | None) -> slice:
    """Rows ``part = (rank, size)`` takes of ``n``: a contiguous share, in rank order
    (:func:`mpidl.comm.split_counts`); all of them without ``part``."""
    if part is None:
        return slice(0, n)
    counts = split_counts(n, part[1])
    start = sum(counts[: part[0]])
    return slice(start, start + counts[part[0]])


def load_npz(path: str, part: tuple[int, int] | None = None
             ) -> dict[str, dict[str, numpy.ndarray]]:
    """Arrays of an ``.npz`` file, as ``{"train": {...}}`` or, when every key ends in
    ``_train`` or ``_test`` (``x_train, y_train, x_test, y_test``), as both splits.

    With ``part = (rank, size)``, only that rank's contiguous share of each array's rows:
    read by rows from an uncompressed archive (``numpy.savez``: each member is an
    ``.npy`` stored as is, so its rows are at a known byte offset), decompressed whole
    and cut from a compressed one (``numpy.savez_compressed``).
    """
    import zipfile

    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):  # NumPy would take it for a pickle and say so
        with open(path, "rb") as f:
            head = f.read(8)
        raise DataError(f"{path}: not an .npz file (it starts with {head!r}; an .npz is a zip "
                        "archive of .npy arrays): save the arrays with numpy.savez(path, "
                        "x=..., y=...)")
    try:
        with numpy.load(path, allow_pickle=False) as z:
            arrays = {k: _npz_rows(z, k, part) for k in z.files}
    except ValueError as e:
        if "pickle" not in str(e):
            raise DataError(f"{path}: not a readable .npz file ({e})") from e
        raise DataError(f"{path}: holds an array of Python objects, which mpidl never loads "
                        "(unpickling can run any code): save numeric arrays (numbers, "
                        "or token ids as integers)") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz file ({e})") from e
    return _by_split(arrays, path)


def _npz_rows(z: Any, key: str, part: tuple[int, int] | None) -> numpy.ndarray:
    """Array ``key`` of the open ``.npz`` ``z`` (``numpy.load``'s), or ``part``'s rows
    of it: read alone where the member is stored uncompressed as a C-ordered ``.npy``
    of numbers, else cut from the whole array."""
    import zipfile

    def cut(a: numpy.ndarray) -> numpy.ndarray:
        return a[_share(len(a), part)] if part is not None and a.ndim else a

    member = key + ".npy"
    if part is None or z.zip.getinfo(member).compress_type != zipfile.ZIP_STORED:
        return cut(z[key])
    fmt = numpy.lib.format
    with z.zip.open(member) as f:
        version = fmt.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            return cut(z[key])
        read_header = fmt.read_array_header_1_0 if version == (1, 0) \
            else fmt.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        if fortran or not shape or dtype.hasobject:  # NumPy's own load raises for objects
            return cut(z[key])
        rows = _share(shape[0], part)
        row_bytes = dtype.itemsize * int(numpy.prod(shape[1:], dtype=numpy.int64))
        f.seek(f.tell() + rows.start * row_bytes)
        data = f.read((rows.stop - rows.start) * row_bytes)
    return numpy.frombuffer(data, dtype).reshape(rows.stop - rows.start, *shape[1:])


def _by_split(arrays: dict[str, Any], path: str) -> dict[str, dict[str, Any]]:
    if not arrays:
        raise DataError(f"{path}: holds no arrays")
    if all(k.endswith(("_train", "_test")) for k in arrays):
        out: dict[str, dict[str, Any]] = {}
        for k, v in arrays.items():
            name, _, split = k.rpartition("_")
            out.setdefault(split, {})[name] = v
        if set(out) != {"train", "test"} or set(out["train"]) != set(out["test"]):
            raise DataError(
                f"{path}: keys {sorted(arrays)}: each feature needs both _train and _test"
            )
        return out
    return {"train": arrays}


def load_h5(path: str, features: list[str] | None = None, part: tuple[int, int] | None = None
            ) -> dict[str, dict[str, numpy.ndarray]]:
    """Datasets of an HDF5 file, read into memory (with ``part = (rank, size)``: only
    that rank's contiguous share of the rows).

    Uses the ``train`` and ``test`` groups when both exist, else the root. ``features``
    names the datasets to take (default: every dataset in the group).

    Only bytes stored in ``path`` itself are read: HDF5 can make a dataset read another
    file (external storage, an external link, a virtual dataset mapping another file),
    so a crafted input would copy any local file the user can read into the shards. Such
    datasets are refused, by name (see :func:`_local`).

    Raises:
        DataError: no such file, not HDF5, a missing dataset, different row counts, or a
            dataset whose bytes are in another file.
    """
    import h5py

    try:
        f = h5py.File(path, "r", locking=False)
    except FileNotFoundError as e:
        raise DataError(f"{path}: no such file") from e
    except OSError as e:
        raise DataError(f"{path}: cannot be opened as HDF5 ({e})") from e
    with f:
        groups = (
            {"train": _local(f, "/train", path), "test": _local(f, "/test", path)}
            if all(isinstance(f.get(s), h5py.Group) for s in ("train", "test"))
            else {"train": f}
        )
        out = {}
        for split, g in groups.items():
            names = features or sorted(k for k in g if g.get(k, getclass=True) is h5py.Dataset)
            missing = [n for n in names if g.get(n, getclass=True) is not h5py.Dataset]
            if missing or not names:
                raise DataError(f"{path}: group {g.name!r} lacks dataset(s) {missing or 'any'}")
            dsets = {n: _local(f, f"{g.name.rstrip('/')}/{n}", path) for n in names}
            rows = {n: (d.shape[0] if d.ndim else None) for n, d in dsets.items()}
            if len(set(rows.values())) != 1 or None in rows.values():
                raise DataError(
                    f"{path}: datasets in {g.name!r} have different row counts {rows}; "
                    "choose datasets with one row per sample (--features)"
                )
            share = _share(next(iter(rows.values())), part)
            out[split] = {n: d[share] for n, d in dsets.items()}
    return out


_COPY_IN = ("mpidl reads only data stored in the input file itself (a link could make it "
            "read any file you can): write the arrays into a file of their own (read them "
            "with h5py, write a new file) and pass that")


def _local(f: Any, name: str, path: str, seen: set[str] | None = None) -> Any:
    """``f[name]`` (a group or a dataset), if its bytes are stored in ``f`` itself.

    Refused: an external link; a path that resolves through one (a soft link to it, a
    group behind it: the object then belongs to another file); a dataset with external
    storage (raw bytes in other files); a virtual dataset with a source in another file
    (a source file name of ``"."`` is this file: its source datasets are checked in turn;
    any other name is refused, this file's own name included, since HDF5 looks a source
    name up at read time, relative to the working directory and ``HDF5_VDS_PREFIX``).
    """
    import h5py

    link = f.get(name, getlink=True)
    if isinstance(link, h5py.ExternalLink):
        raise DataError(f"{path}: {name!r} is an external link to {link.filename}:{link.path}; "
                        f"{_COPY_IN}")
    obj = f[name]
    if obj.file.id != f.id:
        raise DataError(f"{path}: {name!r} resolves, through an external link, to another file "
                        f"({obj.file.filename}); {_COPY_IN}")
    if not isinstance(obj, h5py.Dataset):
        return obj
    if obj.external:
        files = sorted({str(e[0]) for e in obj.external})
        raise DataError(f"{path}: dataset {name!r} keeps its bytes in other file(s) {files} "
                        f"(HDF5 external storage); {_COPY_IN}")
    if obj.is_virtual:
        seen = (seen or set()) | {obj.name}
        for source in obj.virtual_sources():
            if source.file_name != ".":
                raise DataError(f"{path}: virtual dataset {name!r} maps data from "
                                f"{source.file_name}:{source.dset_name}; {_COPY_IN}")
            inner = "/" + source.dset_name.lstrip("/")
            if inner not in seen:
                _local(f, inner, path, seen)
    return obj
