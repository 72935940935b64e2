"""Sparse exchange of embedding gradients: send only the rows a batch touched.

A bag-of-words batch of 64 reviews touches a few thousand rows of a 20000 x 128 table,
yet a dense allreduce moves all 10 MB every step (PyTorch DDP does). Here each rank
gathers every rank's touched row ids and their gradient rows (two ``allgatherv``) and
sums them locally, which gives exactly the dense allreduce's sum (up to the order of
float additions, which is the same on every rank, so replicas stay identical).

Whether sparse pays is decided per step, the same way on every rank (from the
allgathered row counts): sparse when the bytes each rank receives, weighted by
``SPARSE_BYTE_COST``, are fewer than a ring allreduce of the dense table moves, else
the dense allreduce. A rank whose table gradient is dense this step (the table is also
used outside an embedding lookup) sends no count, and every rank goes dense.

The touched rows are a boolean ``(vocab,)`` mask (``weight.grad_row_mask``), unioned
with ``|`` on the device; on a GPU the one host synchronisation per table and step is
the count the decision needs, and the row ids are then compacted on the device.
"""
from __future__ import annotations

from typing import Any

from mpidl.autograd import current_backward_pass
from mpidl.backend import get_array_module, is_cupy


# A gathered byte costs more than an allreduced one: the rows are gathered out of the
# table, and summed back into it, by fancy indexing (several passes), while the dense
# allreduce streams one contiguous buffer. Measured on 2 ranks over shared memory
# (benchmarks/README.md, "Data parallel"): a 20000 x 128 float32 table breaks even at
# about 3000 rows touched per rank, i.e. sparse bytes ~ 0.3 x dense bytes.
SPARSE_BYTE_COST = 3.0


def sparse_is_cheaper(row_counts: list[int], vocab: int, row_bytes: int, size: int) -> bool:
    """True when gathering the touched rows moves fewer bytes than a dense allreduce.

    Args:
        row_counts: rows touched on each rank this step (the same list on every rank).
        vocab: rows of the table.
        row_bytes: bytes of one gradient row.
        size: number of ranks.
    """
    if size == 1:
        return False
    dense = 2 * (size - 1) / size * vocab * row_bytes  # a ring allreduce, per rank
    sparse = sum(row_counts) * (row_bytes + 8)  # rows plus their int64 ids, received
    return SPARSE_BYTE_COST * sparse < dense


def row_ids(touched: Any, count: int) -> Any:
    """The sorted ids of the True rows of the boolean mask ``touched`` (``count`` of them).

    On the host ``flatnonzero``; on a device a prefix sum and a scatter, since
    ``flatnonzero`` there must read its output size back to the host (a sync), which
    ``count`` already is.
    """
    xp = get_array_module(touched)
    if not is_cupy(xp):
        return xp.flatnonzero(touched)
    slot = xp.cumsum(touched, dtype=xp.int64) - 1  # each touched row's place among them
    ids = xp.empty(count + 1, dtype=xp.int64)
    ids[xp.where(touched, slot, count)] = xp.arange(touched.shape[0], dtype=xp.int64)
    return ids[:count]  # the spare last slot took every untouched row's write


def allreduce_rows_(comm: Any, grad: Any, touched: Any, piece_bytes: int | None = None) -> bool:
    """Sum ``grad`` over all ranks in place, sending only the touched rows if cheaper.

    Collective. ``grad`` is a dense ``(vocab, dim)`` gradient that is zero outside the
    rows where the boolean ``(vocab,)`` mask ``touched`` is True on this rank, or
    ``touched`` is None: the gradient may be nonzero anywhere, and every rank takes the
    dense allreduce. Returns True if the sparse exchange was used, False if it fell back
    to the dense allreduce (sent in messages of at most ``piece_bytes`` when given:
    large allreduces are slower per byte).
    """
    xp = get_array_module(grad)
    mine = -1 if touched is None else int(touched.sum())  # on a GPU the step's one sync here
    counts = [int(n) for n in comm.allgather_obj(mine)]
    row_bytes = grad.itemsize * (grad.size // grad.shape[0])
    if min(counts) < 0 or not sparse_is_cheaper(counts, grad.shape[0], row_bytes, comm.size):
        flat = grad.reshape(-1)
        step = flat.size if not piece_bytes else max(1, piece_bytes // flat.itemsize)
        for i in range(0, flat.size, step):
            comm.allreduce_(flat[i:i + step])
        return False
    rows = row_ids(touched, mine)
    ids = comm.allgatherv(xp.ascontiguousarray(rows, dtype=xp.int64))
    values = comm.allgatherv(xp.ascontiguousarray(grad[rows]))
    # Sum in place, touching only the gathered rows (not the whole table): clear ours,
    # then add each rank's block in rank order. Ids are unique within a block, so a
    # fancy-indexed += is exact, and every rank adds in the same order, so replicas
    # stay bit-identical.
    grad[rows] = 0
    start = 0
    for n in counts:
        grad[ids[start:start + n]] += values[start:start + n]
        start += n
    return True


class SparseTables:
    """The embedding tables exchanged by rows, and what each touched since the last sync.

    :class:`~mpidl.parallel.DataParallel` calls :meth:`record` after every backward (the
    passes of a ``no_sync`` cycle add up) and :meth:`sync` when it syncs.

    Args:
        tables: the tables (leaf tensors), in the same order on every rank.
    """

    def __init__(self, tables: list[Any]) -> None:
        self.tables = tables
        self._rows: dict[int, Any] = {}  # id(table) -> mask of rows touched since the sync
        self._dense: set[int] = set()  # tables with a dense gradient since the sync

    def record(self) -> None:
        """Take the rows the last backward touched (not collective)."""
        xp = None
        this_pass = current_backward_pass()
        for p in self.tables:
            if p.dense_grad_pass == this_pass:
                # Reached by something other than an embedding lookup in this pass (a
                # tied output projection, a weight penalty in the loss): its rows alone
                # are not the gradient, so this table goes dense until the next sync.
                self._dense.add(id(p))
            touched = getattr(p, "grad_row_mask", None)
            if touched is None:
                continue
            p.grad_row_mask = None  # consumed: a later pass that skips the table adds none
            xp = xp or get_array_module(p.data)
            seen = self._rows.get(id(p))
            self._rows[id(p)] = touched if seen is None else xp.logical_or(seen, touched)

    def mark(self, masks: list[Any]) -> None:
        """Write each table's rows touched since the last sync into its mask (host bool
        arrays, one per table): all of them where the gradient went dense, none where
        there was no gradient. For a transport that sums the tables itself (the node's
        shared window); not collective."""
        for p, mask in zip(self.tables, masks):
            rows = self._rows.pop(id(p), None)
            if id(p) in self._dense:
                mask[...] = True
            elif rows is None:
                mask[...] = False
            else:
                mask[...] = rows
        self._dense.clear()

    def sync(self, comm: Any, piece_bytes: int | None = None) -> bool:
        """Sum every table's gradient over ``comm``; True if any went by rows. Collective."""
        used = False
        for p in self.tables:
            xp = get_array_module(p.data)
            if p.grad is None:  # no rank-local gradient (e.g. an empty batch)
                p.grad = xp.zeros_like(p.data)
            rows = self._rows.pop(id(p), None)
            if id(p) in self._dense:
                rows = None  # dense here: allreduce_rows_ then runs dense on every rank
            elif rows is None:
                rows = xp.zeros(p.data.shape[0], dtype=bool)
            if comm.size > 1:
                used = allreduce_rows_(comm, p.grad, rows, piece_bytes) or used
        self._dense.clear()
        return used
