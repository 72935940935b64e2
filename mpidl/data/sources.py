"""Read the inputs ``mpidl shard`` accepts: CSV/TSV, a text folder tree, ``.npz``, HDF5.

Each reader returns plain Python/NumPy data split into ``{"train": ..., "test": ...}``
when the input already has splits, and raises :class:`~mpidl.data.format.DataError`
naming the file (and line) for bad input. Nothing is skipped silently, except blank
lines of a CSV file, which hold no record.
"""

from __future__ import annotations

import csv
import io
import os
from typing import Any, NamedTuple, Sequence

import numpy

from mpidl.comm.base import split_counts
from mpidl.data.format import DataError

_TSV_SUFFIXES = (".tsv", ".tab")


class Span(NamedTuple):
    """Bytes ``start .. end`` of a CSV file: whole records, after ``lines_before`` lines."""

    start: int
    end: int
    lines_before: int


def _column(header: list[str] | None, col: str | int, path: str, what: str) -> int:
    if isinstance(col, int) or (
        isinstance(col, str) and col.isdigit() and (header is None or col not in header)
    ):
        return int(col)
    if header is None:
        raise DataError(
            f"{path}: {what} {col!r} is a name but the file has no header; "
            "give a 0-based column number instead"
        )
    if col not in header:
        raise DataError(f"{path}: no {what} {col!r} in the header {header}")
    return header.index(col)


def read_csv(
    path: str,
    text_col: str | int,
    label_col: str | int,
    *,
    delimiter: str | None = None,
    header: bool = True,
    quoting: str | None = None,
    encoding: str = "utf-8",
    span: Span | None = None,
) -> tuple[list[str], list[str]]:
    """Texts and label strings from a CSV or TSV file (or from the records of ``span``).

    Args:
        path: the file, e.g. the common IMDB ``review,sentiment`` CSV.
        text_col, label_col: column names (with a header) or 0-based numbers.
        delimiter: the field separator; by default a tab for ``.tsv``/``.tab`` files and
            a comma otherwise.
        header: whether the first line names the columns.
        quoting: ``"minimal"`` (standard CSV quotes) or ``"none"`` (quotes are ordinary
            characters: right for TSV files such as the UCI sentiment sentences, whose
            unbalanced quotes would otherwise merge lines); by default ``"none"`` for a tab
            delimiter and ``"minimal"`` otherwise.
        span: only the records from byte ``span.start`` to ``span.end`` (a rank's share,
            cut at record boundaries: :func:`mpidl.data.partition.csv_span`); the header
            is still read from the file's start, and line numbers count from it.

    Raises:
        DataError: missing file, bad encoding, unknown column, a line with too few fields
            or an empty label; the message names the file and the line.
    """
    found: dict[str, int] = {}

    def columns(names: list[str] | None) -> tuple[int, str]:
        """The fields a line needs, once the header is known."""
        found["text"] = _column(names, text_col, path, "text column")
        found["label"] = _column(names, label_col, path, "label column")
        return (max(found.values()) + 1,
                f"text column {found['text']}, label column {found['label']}")

    names, rows = _read_rows(path, delimiter, header, quoting, encoding, columns, span)
    ti, li = found["text"], found["label"]
    texts, labels = [], []
    for line, row in rows:
        label = row[li].strip()
        if not label:
            raise DataError(f"{path}:{line}: empty label")
        texts.append(row[ti])
        labels.append(label)
    if not texts and span is None:
        raise DataError(f"{path}: no records")
    return texts, labels


def csv_dialect(path: str, delimiter: str | None, quoting: str | None) -> tuple[str, str]:
    """The field separator and quoting (``"minimal"`` or ``"none"``) to read ``path``
    with: a tab and no quoting for ``.tsv``/``.tab`` files, else a comma and CSV quotes."""
    if delimiter is None:
        delimiter = "\t" if path.lower().endswith(_TSV_SUFFIXES) else ","
    if quoting is None:
        quoting = "none" if delimiter == "\t" else "minimal"
    if quoting not in ("minimal", "none"):
        raise ValueError(f"quoting {quoting!r} is not one of ['minimal', 'none']")
    return delimiter, quoting


def _read_rows(path: str, delimiter: str | None, header: bool, quoting: str | None,
               encoding: str, needed: Any = None, span: Span | None = None
               ) -> tuple[list[str] | None, list[tuple[int, list[str]]]]:
    """The header names (or None) and ``(line number, fields)`` of every non-empty line.

    Every line must have at least the fields the caller reads (``needed(names)`` gives
    their count and names, checked first, for the plainer message) and as many as the
    header (or the first line): an extra field is an unquoted delimiter inside a text,
    which would cut it silently.
    """
    delimiter, quoting = csv_dialect(path, delimiter, quoting)
    modes = {"minimal": csv.QUOTE_MINIMAL, "none": csv.QUOTE_NONE}
    csv.field_size_limit(2**31 - 1)  # whole reviews can exceed the 128 KiB default
    rows = []
    try:
        # utf-8-sig: a byte-order mark (Excel and Windows write one) is not part of the
        # first header name or the first label.
        opened = "utf-8-sig" if encoding.lower().replace("_", "-") in ("utf-8", "utf8") \
            else encoding
        with open(path, newline="", encoding=opened) as f:
            reader = csv.reader(f, delimiter=delimiter, quoting=modes[quoting])
            names = next(reader, None) if header else None
            if header and names is None:
                raise DataError(f"{path}: empty file, expected a header line")
            width = len(names) if names is not None else None
            need, which = needed(names) if needed is not None else (0, "")
            base = 0
            if span is not None:
                if width is None:  # every line must have the first line's fields
                    width = len(next((r for r in reader if r), []) or []) or None
                base = span.lines_before
                reader = csv.reader(io.StringIO(_span_text(path, span, opened)),
                                    delimiter=delimiter, quoting=modes[quoting])
                if header and span.start == 0:
                    next(reader, None)
            for row in reader:
                if not row:
                    continue
                line = base + reader.line_num
                if len(row) < need:
                    raise DataError(
                        f"{path}:{line}: {len(row)} field(s), need at least {need} "
                        f"({which}); check --delimiter/--quoting"
                    )
                width = width or len(row)
                if len(row) != width:
                    raise DataError(
                        f"{path}:{line}: {len(row)} fields where "
                        f"{'the header has' if names is not None else 'the first line has'} "
                        f"{width}: a delimiter inside a text? Quote that field, or check "
                        "--delimiter/--quoting"
                    )
                rows.append((line, row))
    except FileNotFoundError as e:
        raise DataError(f"{path}: no such file") from e
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not valid {encoding} text ({e})") from e
    except csv.Error as e:
        raise DataError(f"{path}: CSV error ({e}); check --delimiter and --quoting") from e
    return names, rows


def _span_text(path: str, span: Span, encoding: str) -> str:
    """The text of bytes ``span.start .. span.end`` of ``path``: whole records, so whole
    characters in UTF-8 (a record boundary follows a newline byte)."""
    with open(path, "rb") as f:
        f.seek(span.start)
        data = f.read(span.end - span.start)
    return data.decode(encoding if span.start == 0 else encoding.replace("-sig", ""))


def read_csv_arrays(path: str, feature_cols: Sequence[str | int],
                    target_cols: Sequence[str | int] = (), *, label_col: str | int | None = None,
                    classes: Sequence[str] | None = None, delimiter: str | None = None,
                    header: bool = True, encoding: str = "utf-8"
                    ) -> tuple[dict[str, numpy.ndarray], list[str] | None]:
    """Numeric columns of a CSV file as arrays: ``x`` (float32, one row per line) from
    ``feature_cols``, and ``y`` from either ``target_cols`` (float32 regression targets:
    one value per row, or a vector) or ``label_col`` (class labels, int64 ids as
    :func:`mpidl.data.text.encode_labels` gives them: the sorted names, or ``classes``).

    Returns:
        ``({"x": ..., "y": ...}, class names)``; the names are None for regression.

    Raises:
        DataError: a column that is not there, a field that is not a number, or a label
            not among ``classes`` (naming the file, the line and the column).
    """
    arrays, labels = read_csv_columns(path, feature_cols, target_cols, label_col=label_col,
                                      delimiter=delimiter, header=header, encoding=encoding)
    if labels is None:
        return arrays, None
    return encode_csv_labels(path, arrays, labels, classes)


class CsvLabels(NamedTuple):
    """The label strings of a CSV file's rows, their line numbers and the column."""

    labels: list[str]
    lines: list[int]
    column: str | int


def read_csv_columns(path: str, feature_cols: Sequence[str | int],
                     target_cols: Sequence[str | int] = (), *,
                     label_col: str | int | None = None, delimiter: str | None = None,
                     header: bool = True, encoding: str = "utf-8", span: Span | None = None
                     ) -> tuple[dict[str, numpy.ndarray], CsvLabels | None]:
    """:func:`read_csv_arrays` before the labels become ids (the ranks of a parallel
    write agree on the class names first): ``{"x": ...}`` (and ``"y"`` for targets),
    and the labels, or None. ``span``: only those records (:func:`read_csv`)."""
    if bool(target_cols) == (label_col is not None):
        raise ValueError("read_csv_arrays: give either target_cols or label_col")
    names, rows = _read_rows(path, delimiter, header, "minimal", encoding, span=span)
    fi = [_column(names, c, path, "feature column") for c in feature_cols]
    ti = [_column(names, c, path, "target column") for c in target_cols]
    li = None if label_col is None else _column(names, label_col, path, "label column")
    if not rows and span is None:
        raise DataError(f"{path}: no records")

    def numbers(cols: list[int], what: str) -> numpy.ndarray:
        out = numpy.empty((len(rows), len(cols)), dtype=numpy.float32)
        for r, (line, row) in enumerate(rows):
            for c, i in enumerate(cols):
                try:
                    out[r, c] = float(row[i])
                except ValueError:
                    col = names[i] if names is not None else i
                    raise DataError(f"{path}:{line}: {what} {col!r} holds {row[i]!r}, not a "
                                    "number") from None
        return out

    x = numbers(fi, "feature column")
    if li is None:
        y = numbers(ti, "target column")
        return {"x": x, "y": y[:, 0] if len(ti) == 1 else y}, None
    return {"x": x}, CsvLabels([row[li].strip() for _, row in rows],
                               [line for line, _ in rows],
                               names[li] if names is not None else li)


def encode_csv_labels(path: str, arrays: dict[str, numpy.ndarray], labels: CsvLabels,
                      classes: Sequence[str] | None) -> tuple[dict[str, numpy.ndarray],
                                                                list[str]]:
    """``arrays`` with ``y``: the ids of ``labels`` among ``classes`` (default: the sorted
    labels); DataError naming the line of a label that is not one of ``classes``."""
    from mpidl.data.text import encode_labels

    if classes is not None:
        known = set(classes)
        for line, label in zip(labels.lines, labels.labels):
            if label not in known:
                raise DataError(f"{path}:{line}: label column {labels.column!r} holds {label!r}, "
                                f"not one of the classes {list(classes)} (--classes)")
    ids, found = encode_labels(labels.labels, classes)
    return {**arrays, "y": ids}, found


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

    With ``part = (rank, size)``, only that rank's contiguous share of each array's rows
    (each array is still decompressed whole: an ``.npz`` member cannot be read by rows).
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
            arrays = {k: z[k] for k in z.files}
            if part is not None:
                arrays = {k: v[_share(len(v), part)] if v.ndim else v
                          for k, v in arrays.items()}
    except ValueError as e:
        if "pickle" not in str(e):
            raise DataError(f"{path}: not a readable .npz file ({e})") from e
        raise DataError(f"{path}: holds an array of Python objects, which mpidl never loads "
                        "(unpickling can run any code): save numeric arrays (numbers, "
                        "or token ids as integers)") from None
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: not a readable .npz file ({e})") from e
    return _by_split(arrays, path)


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
