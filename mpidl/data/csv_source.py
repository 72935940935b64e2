"""Read CSV and TSV inputs of ``mpidl shard``: texts with labels, or numeric columns;
whole files, or a rank's span of records (:mod:`mpidl.data.partition`).

Errors are :class:`~mpidl.data.format.DataError` naming the file and the line. Nothing
is skipped silently, except blank lines, which hold no record.
"""

from __future__ import annotations

import codecs
import csv
import io
from typing import Any, NamedTuple, Sequence

import numpy

from mpidl.data.format import DataError

_TSV_SUFFIXES = (".tsv", ".tab")
_SCAN_BLOCK = 1 << 20  # bytes decoded at a time when looking for an undecodable one


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
        # e.start counts from the start of whichever buffer the decoder held (4096 into
        # a read-ahead block, or into a rank's span): find the byte in the file instead
        raise DataError(_undecodable(path, encoding, e)) from e
    except csv.Error as e:
        raise DataError(f"{path}: CSV error ({e}); check --delimiter and --quoting") from e
    return names, rows


def _undecodable(path: str, encoding: str, error: UnicodeDecodeError) -> str:
    """The message for ``path``'s first byte that is not ``encoding``: its line, its
    offset in the file and the fix; the same whichever rank or buffer met it."""
    decoder = codecs.getincrementaldecoder(encoding)()
    offset = lines = 0  # bytes decoded and newlines among them, before this block
    with open(path, "rb") as f:
        while True:
            block = f.read(_SCAN_BLOCK)
            held = len(decoder.getstate()[0])  # bytes of a character cut by the last block
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                at = offset - held + e.start
                bad = e.object[e.start:e.end]
                lines += e.object[:e.start].count(b"\n")  # the held bytes hold no newline
                return (f"{path}:{lines + 1}: not valid {encoding} text: byte offset {at} "
                        f"holds {bad!r} ({e.reason}); save the file as {encoding} (e.g. "
                        f"`iconv -f latin1 -t {encoding} {path} > NEW.csv` if it is Latin-1)")
            if not block:
                break
            offset += len(block)
            lines += block.count(b"\n")
    return f"{path}: not valid {encoding} text ({error})"  # the file changed since


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
