"""Embedding lookups whose backward touches only the rows that were used.

``embedding(ids, weight)`` gathers rows of a ``(vocab, dim)`` table;
``embedding_bag(ids, weight)`` averages them over the last axis of ``ids`` (a bag of
words). The gradient of the table is dense in shape, as autograd expects, but it is
built from a small table of distinct rows: a zero row for unused ids, the incoming
gradient rows (an id with one token gets its token's row), and one summed row per id
with several tokens; one ``take`` of that table writes the whole gradient in address
order. The sums avoid NumPy's ``add.at`` (50x slower) and any sort: ids with up to
``_PASSES`` tokens are summed in that many *rounds*, each taking one token of every id
still pending (found by scattering token slots into a vocab-sized array) with one
fancy-indexed write; ids with more go through an (ids x bags) count matrix times the
bag gradients (one GEMM), or one BLAS sum per id. The bag forward is one gather and
one batched ``matmul`` with a vector of ``1/L`` (BLAS; 4x faster than
``sum(axis=1)`` over the gathered block), a few bags at a time so the gathered rows
stay in cache. On CuPy the rows are added with ``cupy.add.at`` (atomic adds into the
same allocation).

No host synchronisation on the GPU: the host path's ``unique``/``flatnonzero`` and
boolean-mask writes need the host to know a data-dependent size (CuPy marks
``flatnonzero`` "synchronize!"), so the device path keeps every token (a padding
token adds a zero row), writes padding outputs with ``copyto(where=)``, and records the
touched rows as a bitmap.

Sparse-gradient hook (for data-parallel sparse exchange): after a backward pass, the
weight tensor carries ``weight.grad_row_mask``, a boolean ``(vocab,)`` xp array, True for
the rows that received a gradient in that pass (the union over every embedding call on
the table in the pass). ``weight.grad[weight.grad_row_mask]`` is then all of the
gradient that this pass added; every other row got nothing from it. The attribute is
only meaningful when the table is used by the embedding functions alone in that pass
(not, say, tied to an output projection, which gives it a dense gradient): autograd
then sets the table's ``dense_grad_pass`` to the pass (``Function.row_sparse_grads``).
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.autograd import Function, Tensor, current_backward_pass
from mpidl.backend import get_array_module, is_cupy, to_device, zeros_add_at

# Ids that occur up to this many times in one call are summed in that many rounds;
# ids that occur more often are summed apart (a GEMM or one BLAS sum per id).
_PASSES = 8

# Elements of the gathered rows that the host bag forward keeps at a time (1 MiB).
_GATHER_BLOCK = 1 << 18


def _check_ids(ids: Any, vocab: int, padding_idx: int | None) -> None:
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding ids must be integers, got dtype {ids.dtype}")
    # Out-of-range ids would wrap or fail deep inside take; a GPU check would cost a
    # sync, so only host arrays are checked: ids from the host (a loader's batch) are
    # checked before they move to a device table (_ids_data), ids already on a device
    # are not.
    if get_array_module(ids) is numpy and ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise IndexError(f"embedding id {bad} is out of range for a table of {vocab} rows")
    if padding_idx is not None and not -vocab <= padding_idx < vocab:
        raise ValueError(f"padding_idx={padding_idx} is out of range for {vocab} rows")


def segment_sum(
    xp: Any, ids: Any, rows: Any, owner: Any, vocab: int, drop: int | None = None,
    out: Any = None,
) -> tuple[Any, Any]:
    """Dense ``(vocab, dim)`` sum of each token's gradient row into its id; touched rows.

    Token ``t`` (id ``ids[t]``) carries the gradient row ``rows[owner[t]]``, or
    ``rows[t]`` when ``owner`` is None. Bags share one row per bag, so ``rows`` is then
    ``(bags, dim)`` and never repeated per token up front. Returns the gradient and the
    boolean ``(vocab,)`` mask of the ids that have a token. ``drop`` (device arrays
    only): tokens of this id (padding) contribute nothing and do not count as touched;
    host callers leave such tokens out of ``ids`` instead. ``out``: a host ``(vocab,
    dim)`` array of ``rows``' dtype to write the gradient into (the table's gradient
    buffer: data parallelism's flat, which would otherwise take a copy per step).

    On the host, every row of the result is one row of a small table ``ext``: a zero
    row (ids without tokens), ``rows`` itself (an id with a single token is that
    token's row), then the sums of the ids with several tokens (:func:`_rounds`) and of
    the frequent ones (:func:`_frequent_sums`). One ``take`` of ``ext`` writes the
    whole gradient in address order: no zero-fill of the table, no scatter into it
    (against zero-fill plus scattered writes, the bow backward ran 12 % faster).
    """
    n = ids.shape[0]
    dim = rows.shape[1]
    if n == 0:
        if out is None:
            return xp.zeros((vocab, dim), dtype=rows.dtype), xp.zeros(vocab, dtype=bool)
        out[...] = 0
        return out, xp.zeros(vocab, dtype=bool)
    if is_cupy(xp):
        # On the GPU, atomic adds into the one allocation are the fast path (cupy's
        # ufunc.at is cupyx.scatter_add); the CPU's add.at is what the rounds avoid.
        values = rows if owner is None else rows[owner]
        touched = xp.zeros(vocab, dtype=bool)
        touched[ids] = True  # a scatter: no data-dependent size, no sync (unlike unique)
        if drop is not None:
            values = xp.where((ids == drop)[:, None], xp.zeros((), values.dtype), values)
            touched[drop] = False
        return zeros_add_at(xp, (vocab, dim), ids, values), touched
    counts = xp.bincount(ids, minlength=vocab)
    unique = xp.flatnonzero(counts)  # sorted, without a sort
    src = xp.arange(n) if owner is None else owner
    n_rows = rows.shape[0]
    per_token = counts[ids]
    any_frequent = int(counts.max()) > _PASSES
    several = counts > 1
    if any_frequent:
        several &= counts <= _PASSES
    several_ids = xp.flatnonzero(several)
    frequent_ids = xp.flatnonzero(counts > _PASSES) if any_frequent else unique[:0]
    m, f = several_ids.shape[0], frequent_ids.shape[0]
    ext = xp.empty((1 + n_rows + m + f, dim), dtype=rows.dtype)
    ext[0] = 0
    ext[1:1 + n_rows] = rows
    index = xp.zeros(vocab, dtype=xp.intp)  # id -> its row of ext
    # Every token writes its own row; right for ids with one token, and the others
    # are overwritten below.
    index[ids] = src + 1
    start = 1 + n_rows
    if m:
        index[several_ids] = xp.arange(start, start + m)
        tokens = per_token > 1
        if any_frequent:
            tokens &= per_token <= _PASSES
        _rounds(xp, ext[start:start + m], ids[tokens], rows, src[tokens], counts, several_ids)
    start += m
    if f:
        index[frequent_ids] = xp.arange(start, start + f)
        tokens = per_token > _PASSES
        _frequent_sums(xp, ext[start:], ids[tokens], rows, src[tokens], frequent_ids, vocab)
    grad = xp.empty((vocab, dim), dtype=rows.dtype) if out is None else out
    xp.take(ext, index, axis=0, out=grad, mode="clip")  # index is in range
    return grad, counts > 0


# Rows moved per chunk in a round (1 MiB of float32 rows of 128): the gathered rows
# stay in cache between the two gathers, the add and the write.
_ROUND_CHUNK = 2048


def _rounds(xp: Any, sums: Any, ids: Any, rows: Any, src: Any, counts: Any,
            ids_left: Any) -> None:
    """``sums[j] = sum of rows[src[t]] over ids[t] == ids_left[j]``, ids with few tokens.

    ``counts`` holds each id's number of tokens (at most ``_PASSES`` here) and
    ``ids_left`` the sorted distinct ids of ``ids``. Round ``k`` handles the ``k``-th
    token of every id that has one: token slots are scattered into ``pos`` by id
    (whichever write lands, ``pos[i]`` is then one token of id ``i``), so
    ``pos[ids_left]`` picks one token per id, in increasing id order. Round 0 gathers
    those rows straight into ``sums``; later rounds add theirs with one fancy-indexed
    assignment per chunk (distinct ids, so this is safe); the picked tokens leave. No
    sort, no ``add.at`` (50x slower), and ``sums[at] += v`` is spelled out as take,
    add, assign (10x faster in NumPy). ``take`` rather than fancy indexing: 1.3x
    faster for whole rows; ``mode="clip"`` skips a buffered bounds check (indices are
    in range by construction).
    """
    pos = xp.empty(counts.shape[0], dtype=xp.intp)
    slot = xp.empty(counts.shape[0], dtype=xp.intp)  # id -> its row of sums
    slot[ids_left] = xp.arange(ids_left.shape[0])
    chunk = min(_ROUND_CHUNK, ids_left.shape[0])
    buf = xp.empty((2, chunk, rows.shape[1]), dtype=rows.dtype)
    k = 0
    while ids.shape[0]:
        if k:
            ids_left = ids_left[counts[ids_left] > k]  # the ids with a k-th token
        pos[ids] = xp.arange(ids.shape[0])
        picked = pos[ids_left]  # one token per id, by increasing id
        from_rows = src[picked]
        if k == 0:
            xp.take(rows, from_rows, axis=0, out=sums, mode="clip")
        else:
            at_all = slot[ids_left]
            for a in range(0, ids_left.shape[0], chunk):
                b = min(a + chunk, ids_left.shape[0])
                at, vals, old = at_all[a:b], buf[0, :b - a], buf[1, :b - a]
                xp.take(rows, from_rows[a:b], axis=0, out=vals, mode="clip")
                xp.take(sums, at, axis=0, out=old, mode="clip")
                vals += old
                sums[at] = vals
        left = xp.ones(ids.shape[0], dtype=bool)
        left[picked] = False
        ids, src = ids[left], src[left]
        k += 1


def _frequent_sums(xp: Any, sums: Any, ids: Any, rows: Any, src: Any, frequent_ids: Any,
                   vocab: int) -> None:
    """``sums[j] = sum of rows[src[t]] over ids[t] == frequent_ids[j]`` (few ids)."""
    f, n_rows = frequent_ids.shape[0], rows.shape[0]
    if f * n_rows <= 16 * ids.shape[0]:
        # Bags (few shared rows): count how often each frequent id takes each row,
        # then one GEMM (F, rows) @ (rows, dim) does every sum; its F x rows
        # multiply-adds per column cost at most 16 per token.
        rank = xp.zeros(vocab, dtype=xp.intp)
        rank[frequent_ids] = xp.arange(f)
        counts = xp.bincount(rank[ids] * n_rows + src, minlength=f * n_rows)
        xp.matmul(counts.reshape(f, n_rows).astype(rows.dtype), rows, out=sums)
        return
    # Otherwise one BLAS sum per frequent id over its tokens, grouped by a stable sort.
    order = xp.argsort(ids, kind="stable")
    ids, src = ids[order], src[order]
    ends = xp.searchsorted(ids, frequent_ids, side="right")
    ones = xp.ones(int(xp.diff(ends, prepend=0).max()), dtype=rows.dtype)
    a = 0
    for j, b in enumerate(ends.tolist()):
        sums[j] = xp.matmul(ones[:b - a], rows[src[a:b]])
        a = b


def _bag_sums(xp: Any, table: Any, ids: Any, weights: Any) -> Any:
    """``weights (L,) @ table[ids] (B, L, D)`` -> ``(B, D)``: weighted sums of the bags.

    On the host the rows are gathered a few bags at a time into one reused buffer of
    about ``_GATHER_BLOCK`` elements, which stays in cache for the BLAS products (the
    whole ``(B, L, D)`` block of the bow benchmark is 8 MB; chunked, its forward takes
    20 % less time within a training step). Ids must be in range (``mode="clip"``
    skips NumPy's buffered bounds check; :func:`_check_ids` ran).
    """
    n_bags, bag = ids.shape
    dim = table.shape[1]
    if is_cupy(xp) or n_bags * bag * dim <= _GATHER_BLOCK:
        gathered = xp.take(table, ids.reshape(-1), axis=0)
        return xp.matmul(weights, gathered.reshape(n_bags, bag, dim))
    per = max(1, _GATHER_BLOCK // (bag * dim))  # bags per chunk
    buf = xp.empty((per * bag, dim), dtype=table.dtype)
    out = xp.empty((n_bags, dim), dtype=table.dtype)
    for b in range(0, n_bags, per):
        e = min(b + per, n_bags)
        rows = buf[:(e - b) * bag]
        xp.take(table, ids[b:e].reshape(-1), axis=0, out=rows, mode="clip")
        xp.matmul(weights, rows.reshape(e - b, bag, dim), out=out[b:e])
    return out


def _table_buffer(f: Function, g: Any) -> Any:
    """Where ``f``'s backward may write the table's gradient: its leaf's gradient buffer
    (a host one of the right shape and dtype), or None for a fresh array."""
    out = f.grad_buffer_for(1)
    if (out is None or is_cupy(get_array_module(g)) or out.dtype != g.dtype
            or out.shape != (f.vocab, f.dim) or not out.flags.c_contiguous):
        return None
    return out


def _record_rows(weight: Any, touched: Any) -> None:
    """Attach ``grad_row_mask`` (union within one backward pass) to the weight tensor."""
    if not isinstance(weight, Tensor):
        return
    xp = get_array_module(touched)
    this_pass = current_backward_pass()
    seen = getattr(weight, "grad_row_mask", None)
    if getattr(weight, "_grad_rows_pass", None) == this_pass and seen is not None:
        weight.grad_row_mask = xp.logical_or(seen, touched)
    else:
        weight.grad_row_mask = touched
    weight._grad_rows_pass = this_pass


class Embedding(Function):
    owned_grads = (1,)  # the table gradient is a fresh zeroed array
    row_sparse_grads = (1,)  # rows recorded by _record_rows

    def forward(self, ids, weight):
        xp = get_array_module(weight)
        self.ids, self.vocab = ids, weight.shape[0]
        self.dim, self.dtype = weight.shape[1], weight.dtype
        out = xp.take(weight, ids, axis=0)  # (..., D)
        if self.padding_idx is not None:
            # copyto(where=), not a boolean-mask write: that needs the mask's count
            # on the host (a GPU sync); the same values either way.
            pad = (ids == self.padding_idx % self.vocab)[..., None]
            xp.copyto(out, xp.zeros((), dtype=out.dtype), where=pad)
        return out

    def backward(self, gy):
        xp = get_array_module(gy)
        flat = self.ids.reshape(-1)
        g = gy.reshape(-1, self.dim)  # (N, D)
        owner, drop = None, None
        if self.padding_idx is not None and is_cupy(xp):
            drop = self.padding_idx % self.vocab  # kept, adding zeros: no compaction sync
        elif self.padding_idx is not None:
            owner = xp.flatnonzero(flat != self.padding_idx % self.vocab)
            flat = flat[owner]
        grad, touched = segment_sum(xp, flat, g, owner, self.vocab, drop,
                                    _table_buffer(self, g))
        _record_rows(self.inputs[1], touched)
        return None, grad


class EmbeddingBag(Function):
    owned_grads = (1,)
    row_sparse_grads = (1,)  # rows recorded by _record_rows

    def forward(self, ids, weight):
        xp = get_array_module(weight)
        vocab, dim = weight.shape
        self.ids, self.vocab, self.dim = ids, vocab, dim
        bag = ids.shape[-1]
        # The mean is folded into the per-token weights of the bag sums.
        weights = xp.full(bag, 1.0 if self.padding_idx is not None else 1.0 / max(bag, 1),
                          dtype=weight.dtype)
        out = _bag_sums(xp, weight, ids.reshape(-1, bag), weights)  # (B, D)
        if self.padding_idx is None:
            self.scale = None
        else:
            pad = self.padding_idx % vocab
            n_pad = (ids.reshape(-1, bag) == pad).sum(axis=1)  # (B,)
            # Padding rows are in the sum: take them out, then divide by the real count.
            out -= n_pad[:, None].astype(weight.dtype) * weight[pad]
            scale = 1.0 / xp.maximum(bag - n_pad, 1).astype(weight.dtype)
            out *= scale[:, None]
            self.scale = scale
        return out.reshape(*ids.shape[:-1], dim)

    def backward(self, gy):
        xp = get_array_module(gy)
        bag = self.ids.shape[-1]
        flat = self.ids.reshape(-1)
        g = gy.reshape(-1, self.dim)  # (B, D)
        if self.scale is None:
            g = g * gy.dtype.type(1.0 / max(bag, 1))
        else:
            g = g * self.scale[:, None].astype(gy.dtype, copy=False)
        drop = None
        if self.padding_idx is not None and is_cupy(xp):
            drop = self.padding_idx % self.vocab  # kept, adding zeros: no compaction sync
            tokens = xp.arange(flat.shape[0])
        elif self.padding_idx is not None:
            tokens = xp.flatnonzero(flat != self.padding_idx % self.vocab)
            flat = flat[tokens]
        else:
            tokens = xp.arange(flat.shape[0])
        owner = tokens // bag  # token t belongs to bag t // L
        grad, touched = segment_sum(xp, flat, g, owner, self.vocab, drop,
                                    _table_buffer(self, g))
        _record_rows(self.inputs[1], touched)
        return None, grad


def _ids_data(ids: Any, weight: Any, padding_idx: int | None) -> Any:
    """``ids`` as an array on ``weight``'s device, checked while they are still on the host."""
    ids = ids.data if isinstance(ids, Tensor) else ids
    if not hasattr(ids, "dtype"):
        ids = numpy.asarray(ids)  # a list of ids
    _check_ids(ids, weight.shape[0], padding_idx)
    xp = get_array_module(weight)
    if get_array_module(ids) is not xp:
        ids = to_device(ids, xp)  # host ids for a device table
    return ids


def embedding(ids: Any, weight: Any, padding_idx: int | None = None) -> Tensor:
    """Rows of ``weight`` (``(vocab, dim)``) at integer ``ids``: shape ``ids.shape + (dim,)``.

    Args:
        ids: integer array (or Tensor) of any shape; not differentiated.
        weight: the table.
        padding_idx: an id whose output is zeros and whose row gets no gradient.
    """
    ids = _ids_data(ids, weight, padding_idx)
    return Embedding.apply(ids, weight, padding_idx=padding_idx)


def embedding_bag(ids: Any, weight: Any, padding_idx: int | None = None) -> Tensor:
    """Mean of the rows of ``weight`` over the last axis of ``ids`` (bags of equal length).

    ``ids`` of shape ``(..., L)`` gives ``(..., dim)``. With ``padding_idx``, that id
    is left out of each mean (a bag of only padding gives zeros), as PyTorch's
    ``EmbeddingBag(mode="mean", padding_idx=...)``.
    """
    ids = _ids_data(ids, weight, padding_idx)
    if ids.ndim < 1:
        raise ValueError("embedding_bag needs ids with at least one axis (the bag)")
    return EmbeddingBag.apply(ids, weight, padding_idx=padding_idx)
