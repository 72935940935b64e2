"""Embedding lookups whose backward touches only the rows that were used.

``embedding(ids, weight)`` gathers rows of a ``(vocab, dim)`` table;
``embedding_bag(ids, weight)`` averages them over the last axis of ``ids`` (a bag of
words). The gradient of the table is dense in shape, as autograd expects, but it is
built with one zeroed allocation plus *sorted segment sums*: the token ids are sorted
once; each id's first occurrence is written directly, repeats are added in a few
vectorised passes, and very frequent ids get one BLAS sum of their run. For bags, whose
tokens share their bag's gradient row, an (ids x bags) count matrix times the bag
gradients does it in one GEMM. Never NumPy's ``add.at`` over every token, never a
dense ``vocab x dim`` temporary per token. On CuPy the rows are added with
``cupy.add.at`` (atomic adds into the same allocation).

Sparse-gradient hook (for data-parallel sparse exchange): after a backward pass, the
weight tensor carries ``weight.grad_rows``, the sorted unique row ids (an xp integer
array) that received a gradient in that pass (the union over every embedding call on
the table in the pass). ``weight.grad[weight.grad_rows]`` is then all of the gradient
that this pass added; every other row got nothing from it. The attribute is only
meaningful when the table is used by the embedding functions alone (not, say, tied to
an output projection, which gives it a dense gradient).
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.autograd import Function, Tensor, current_backward_pass
from mpidl.backend import get_array_module, is_cupy, to_device

# Rows that occur up to this many times are summed in that many vectorised passes;
# rows that occur more often go through one add.reduceat.
_PASSES = 8


def _check_ids(ids: Any, vocab: int, padding_idx: int | None) -> None:
    if ids.dtype.kind not in "iu":
        raise TypeError(f"embedding ids must be integers, got dtype {ids.dtype}")
    # Out-of-range ids would wrap or fail deep inside take; a GPU check would cost a
    # sync, so only host arrays are checked.
    if get_array_module(ids) is numpy and ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise IndexError(f"embedding id {bad} is out of range for a table of {vocab} rows")
    if padding_idx is not None and not -vocab <= padding_idx < vocab:
        raise ValueError(f"padding_idx={padding_idx} is out of range for {vocab} rows")


def segment_sum(
    xp: Any, ids: Any, rows: Any, owner: Any, vocab: int
) -> tuple[Any, Any]:
    """Dense ``(vocab, dim)`` sum of each token's gradient row into its id; unique ids.

    Token ``t`` (id ``ids[t]``) carries the gradient row ``rows[owner[t]]``, or
    ``rows[t]`` when ``owner`` is None. Bags share one row per bag, so ``rows`` is then
    ``(bags, dim)`` and never repeated per token up front.
    """
    n = ids.shape[0]
    grad = xp.zeros((vocab, rows.shape[1]), dtype=rows.dtype)
    if n == 0:
        return grad, ids[:0]
    if is_cupy(xp):
        # On the GPU, atomic adds into the one allocation are the fast path (cupy's
        # ufunc.at is cupyx.scatter_add); the CPU's add.at is what the sort avoids.
        xp.add.at(grad, ids, rows if owner is None else rows[owner])
        return grad, xp.unique(ids)
    order = xp.argsort(ids)
    sorted_ids = ids[order]
    first = xp.empty(n, dtype=bool)
    first[0] = True
    xp.not_equal(sorted_ids[1:], sorted_ids[:-1], out=first[1:])
    starts = xp.flatnonzero(first)  # (U,) where each id's run begins
    unique = sorted_ids[starts]
    if owner is not None and unique.size * rows.shape[0] <= 64 * n:
        # Bags: count how often each id occurs in each bag, then one GEMM
        # (U, bags) @ (bags, dim) does every sum. Cheap while U x bags stays small.
        run = xp.cumsum(first) - 1  # run index of each sorted token
        key = run * rows.shape[0] + owner[order]
        counts = xp.bincount(key, minlength=unique.size * rows.shape[0])
        counts = counts.reshape(unique.size, rows.shape[0]).astype(rows.dtype)
        grad[unique] = xp.matmul(counts, rows)
        return grad, unique
    vals = rows[order] if owner is None else rows[owner[order]]  # (N, dim), sorted by id
    lengths = xp.diff(starts, append=n)
    grad[unique] = vals[starts]  # every id's first occurrence: a plain write
    short = lengths <= _PASSES
    for k in range(1, _PASSES):
        # The k-th occurrence of every id that has one: distinct rows, so += is safe.
        sel = xp.flatnonzero(short & (lengths > k))
        if sel.size == 0:
            break
        grad[unique[sel]] += vals[starts[sel] + k]
    # Frequent ids (a few, with many tokens each): one BLAS sum of each run.
    ones = None
    for j in xp.flatnonzero(~short).tolist():
        a, m = int(starts[j]), int(lengths[j])
        if ones is None:
            ones = xp.ones(int(lengths.max()), dtype=rows.dtype)
        grad[unique[j]] = xp.matmul(ones[:m], vals[a:a + m])
    return grad, unique


def _record_rows(weight: Any, rows: Any) -> None:
    """Attach ``grad_rows`` (union within one backward pass) to the weight tensor."""
    if not isinstance(weight, Tensor):
        return
    xp = get_array_module(rows)
    this_pass = current_backward_pass()
    if getattr(weight, "_grad_rows_pass", None) == this_pass and weight.grad_rows is not None:
        weight.grad_rows = xp.unique(xp.concatenate([weight.grad_rows, rows]))
    else:
        weight.grad_rows = rows
    weight._grad_rows_pass = this_pass


class Embedding(Function):
    def forward(self, ids, weight):
        xp = get_array_module(weight)
        self.ids, self.vocab = ids, weight.shape[0]
        self.dim, self.dtype = weight.shape[1], weight.dtype
        out = xp.take(weight, ids, axis=0)  # (..., D)
        if self.padding_idx is not None:
            out[ids == self.padding_idx % self.vocab] = 0
        return out

    def backward(self, gy):
        xp = get_array_module(gy)
        flat = self.ids.reshape(-1)
        g = gy.reshape(-1, self.dim)  # (N, D)
        owner = None
        if self.padding_idx is not None:
            owner = xp.flatnonzero(flat != self.padding_idx % self.vocab)
            flat = flat[owner]
        grad, rows = segment_sum(xp, flat, g, owner, self.vocab)
        _record_rows(self.inputs[1], rows)
        return None, grad


class EmbeddingBag(Function):
    def forward(self, ids, weight):
        xp = get_array_module(weight)
        vocab, dim = weight.shape
        self.ids, self.vocab, self.dim = ids, vocab, dim
        bag = ids.shape[-1]
        gathered = xp.take(weight, ids.reshape(-1), axis=0).reshape(-1, bag, dim)  # (B, L, D)
        out = gathered.sum(axis=1)  # (B, D)
        if self.padding_idx is None:
            out *= weight.dtype.type(1.0 / max(bag, 1))
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
        if self.padding_idx is not None:
            tokens = xp.flatnonzero(flat != self.padding_idx % self.vocab)
            flat = flat[tokens]
        else:
            tokens = xp.arange(flat.shape[0])
        owner = tokens // bag  # token t belongs to bag t // L
        grad, rows = segment_sum(xp, flat, g, owner, self.vocab)
        _record_rows(self.inputs[1], rows)
        return None, grad


def _ids_data(ids: Any, weight: Any) -> Any:
    ids = ids.data if isinstance(ids, Tensor) else ids
    xp = get_array_module(weight)
    if not hasattr(ids, "dtype"):
        ids = xp.asarray(ids)  # a list of ids
    elif get_array_module(ids) is not xp:
        ids = to_device(ids, xp)  # host ids for a device table
    return ids


def embedding(ids: Any, weight: Any, padding_idx: int | None = None) -> Tensor:
    """Rows of ``weight`` (``(vocab, dim)``) at integer ``ids``: shape ``ids.shape + (dim,)``.

    Args:
        ids: integer array (or Tensor) of any shape; not differentiated.
        weight: the table.
        padding_idx: an id whose output is zeros and whose row gets no gradient.
    """
    ids = _ids_data(ids, weight)
    _check_ids(ids, weight.shape[0], padding_idx)
    return Embedding.apply(ids, weight, padding_idx=padding_idx)


def embedding_bag(ids: Any, weight: Any, padding_idx: int | None = None) -> Tensor:
    """Mean of the rows of ``weight`` over the last axis of ``ids`` (bags of equal length).

    ``ids`` of shape ``(..., L)`` gives ``(..., dim)``. With ``padding_idx``, that id
    is left out of each mean (a bag of only padding gives zeros), as PyTorch's
    ``EmbeddingBag(mode="mean", padding_idx=...)``.
    """
    ids = _ids_data(ids, weight)
    if ids.ndim < 1:
        raise ValueError("embedding_bag needs ids with at least one axis (the bag)")
    _check_ids(ids, weight.shape[0], padding_idx)
    return EmbeddingBag.apply(ids, weight, padding_idx=padding_idx)
