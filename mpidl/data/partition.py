"""Each rank's share of an input of ``mpiexec -n P mpidl shard``: a CSV file's byte
range cut at record boundaries (texts, or numeric columns), a contiguous share of a text
folder's files (:func:`read_folder_share`); arrays of ``.npz`` and HDF5 files are cut
by rows where they are read (``part`` of :func:`mpidl.data.sources.load_npz`, ``load_h5``).

``mpiexec -n P mpidl shard --from-csv FILE`` gives rank ``r`` bytes
``[r S / P, (r + 1) S / P)`` of the ``S``-byte file, moved forward to the next record
boundary, so every rank reads and parses only its own bytes and every record is read by
exactly one rank.

Where a record ends: after a newline byte that is not inside a quoted field. With CSV
quoting (RFC 4180, Python's ``csv`` defaults: ``"`` quotes, a quote inside a field
doubled) a byte is inside a quoted field exactly when an odd number of quote bytes
precede it, since doubled quotes leave the count's parity alone. So each rank counts the
quote bytes (and newlines, for line numbers in error messages) of its nominal range,
the counts are gathered, and each rank then knows the parity at its nominal start and
walks forward to the first newline at even parity. A review with a quoted newline is
never cut. Without quoting (``--quoting none``, TSV), every newline ends a record.

Cost: one read of the file, split over the ranks (``bytes.count`` runs at memory speed),
plus each rank's walk to its boundary (one record, typically); then each rank reads its
range again to parse it (from the page cache when it fits).

A rank whose nominal range holds no boundary (a record longer than ``S / P``) gets an
empty range; the rank before it reads the long record.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from mpidl.comm.base import split_counts
from mpidl.data import sources
from mpidl.data.format import DataError
from mpidl.data.parallel import agreed
from mpidl.data.sources import Span
from mpidl.data.text import default_classes

_BLOCK = 16 << 20  # bytes read at a time


def _counts(path: str, start: int, end: int) -> tuple[int, int]:
    """Quote and newline bytes in ``[start, end)`` of ``path``."""
    quotes = newlines = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            block = f.read(min(_BLOCK, left))
            if not block:
                break
            quotes += block.count(b'"')
            newlines += block.count(b"\n")
            left -= len(block)
    return quotes, newlines


def _boundary(path: str, nominal: int, odd: bool, quoted: bool, size: int) -> tuple[int, int]:
    """The first record start at or after ``nominal`` (``odd``: an odd number of quotes
    precede ``nominal``), and the newlines in ``[nominal, that start)``."""
    if nominal == 0:
        return 0, 0
    newlines = 0
    with open(path, "rb") as f:
        f.seek(nominal - 1)  # the byte before a record start is a newline
        at = nominal - 1
        first = True
        while block := f.read(_BLOCK):
            for i, byte in enumerate(block):
                if byte == 0x22 and quoted and not first:  # '"'
                    odd = not odd
                elif byte == 0x0A:  # '\n'
                    newlines += not first  # the one before nominal is already counted
                    if not odd:
                        return at + i + 1, newlines
                first = False
            at += len(block)
    return size, newlines


def csv_span(comm: Any, path: str, quoted: bool) -> Span:
    """This rank's :class:`~mpidl.data.sources.Span` of the CSV file ``path``.

    Collective: every rank of ``comm`` calls it with the same ``path`` and ``quoted``
    (whether ``"`` quotes fields); the spans of ranks ``0 .. size - 1`` tile the file in
    order. A file a rank cannot read raises ``OSError`` on every rank.
    """
    size = agreed(comm, os.path.getsize, path)
    cuts = [size * r // comm.size for r in range(comm.size + 1)]
    counts = comm.allgather_obj(agreed(comm, _counts, path, cuts[comm.rank],
                                       cuts[comm.rank + 1]))
    before_q = sum(q for q, _ in counts[: comm.rank])
    before_n = sum(n for _, n in counts[: comm.rank])
    start, extra = agreed(comm, _boundary, path, cuts[comm.rank],
                          quoted and before_q % 2 == 1, quoted, size)
    starts = comm.allgather_obj(start) + [size]
    # a boundary found past the next rank's start belongs to that rank: never overlap
    end = max(start, starts[comm.rank + 1])
    return Span(start, end, before_n + extra)


def _exists(path: str) -> None:
    # Checked by every rank and agreed on: a file that only some nodes see (a node-local
    # path) must stop every rank, not leave the others waiting in a collective.
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")


def read_csv_share(comm: Any, path: str, text_col: str | int, label_col: str | int, *,
                   delimiter: str | None = None, header: bool = True,
                   quoting: str | None = None) -> tuple[list[str], list[str]]:
    """This rank's texts and labels of a CSV file (:func:`mpidl.data.sources.read_csv` of
    its :func:`csv_span`). Collective; an error on one rank is raised on every rank."""
    agreed(comm, _exists, path)
    _, quoting = sources.csv_dialect(path, delimiter, quoting)
    span = csv_span(comm, path, quoted=quoting == "minimal")
    return agreed(comm, sources.read_csv, path, text_col, label_col, delimiter=delimiter,
                  header=header, quoting=quoting, span=span)


def share(items: Sequence[Any], comm: Any) -> list[Any]:
    """This rank's contiguous share of ``items`` (:func:`mpidl.comm.split_counts`)."""
    counts = split_counts(len(items), comm.size)
    start = sum(counts[: comm.rank])
    return list(items[start : start + counts[comm.rank]])


def read_folder_share(comm: Any, root: str, classes: list[str] | None = None
                      ) -> tuple[dict[str, tuple[list[str], list[str]]], list[str]]:
    """This rank's share of each split of a folder of texts
    (:func:`mpidl.data.sources.read_folder`): rank 0 lists the files (one listing, not
    one per rank, on a parallel filesystem), each rank reads its contiguous share of
    every split's list. Collective; errors raised on every rank."""
    listed = comm.bcast_obj(agreed(comm, lambda: sources.list_folder(root, classes)
                                   if comm.rank == 0 else None))
    splits, found = listed
    mine = {name: (share(paths, comm), share(labels, comm))
            for name, (paths, labels) in splits.items()}
    texts = agreed(comm, lambda: {name: sources.read_texts(paths)
                                  for name, (paths, _) in mine.items()})
    return {name: (texts[name], labels) for name, (_, labels) in mine.items()}, found


def read_csv_arrays_share(comm: Any, path: str, feature_cols: Sequence[str | int],
                          target_cols: Sequence[str | int] = (), *,
                          label_col: str | int | None = None,
                          classes: Sequence[str] | None = None, delimiter: str | None = None,
                          header: bool = True) -> tuple[dict[str, Any], list[str] | None]:
    """This rank's rows of :func:`mpidl.data.sources.read_csv_arrays`: its span's
    numbers, and labels as ids of the class names every rank agrees on (given, or the
    sorted union of every rank's labels). Collective; errors raised on every rank."""
    agreed(comm, _exists, path)
    span = csv_span(comm, path, quoted=True)
    arrays, labels = agreed(comm, sources.read_csv_columns, path, feature_cols, target_cols,
                            label_col=label_col, delimiter=delimiter, header=header, span=span)
    if labels is None:
        return arrays, None
    if classes is None:
        seen = comm.allgather_obj(set(labels.labels))
        classes = default_classes(set().union(*seen))
    return agreed(comm, sources.encode_csv_labels, path, arrays, labels, classes)
