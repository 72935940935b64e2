"""The loss of logits split over the vocabulary: cross-entropy and next-token hits.

A tensor-parallel output layer (:mod:`mpidl.parallel.tensor`) leaves each rank the
logits of its share of the classes, ``(..., V_r)``. Gathering the full logits would cost
``V / V_r`` times the memory; instead the softmax's statistics (the row maximum, the sum
of exponentials, the target's logit) are reduced over the tensor group, as Megatron-LM's
vocab-parallel cross-entropy does.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, to_device
from mpidl.comm.base import Communicator
from mpidl.nn.module import as_input


class VocabParallelCrossEntropy(Function):
    def forward(self, logits, labels):
        xp = get_array_module(logits)
        comm = self.comm
        n_local = logits.shape[-1]
        x = logits.reshape(-1, n_local)  # (N, V_r)
        # 16-bit logits: the statistics in float32. MPI has no float16 max on every
        # library (mpidl sums float16 only), and the sum of exponentials over a split
        # vocabulary loses what float16 cannot hold. The gradient comes back in the
        # logits' dtype, the loss stays float32 as softmax_cross_entropy's does (a
        # bfloat16 loss sum of a batch keeps 8 bits; it read 276 for 276.3).
        self.dtype = x.dtype
        out = x.dtype
        if x.dtype.itemsize < 4:
            x = x.astype(numpy.float32)
            out = x.dtype
        t = labels.reshape(-1)
        valid = t != self.ignore_index if self.ignore_index is not None else None
        if xp is numpy:  # a device check would cost a sync, as in softmax_cross_entropy
            bad = (t < 0) | (t >= self.vocab)
            if valid is not None:
                bad &= valid
        if xp is numpy and bad.any():
            raise ValueError(f"vocab_parallel_cross_entropy: label {t[bad][0]} is out of "
                             f"range for {self.vocab} classes (ignore_index="
                             f"{self.ignore_index})")
        m = x.max(axis=1)  # (N,)
        if comm.size > 1:
            comm.allreduce_(m, op="max")
        e = x - m[:, None]
        local = t - self.vocab_start
        mine = (local >= 0) & (local < n_local)
        if valid is not None:
            mine &= valid
        local = xp.where(mine, local, 0)
        rows = xp.arange(t.shape[0])
        both = xp.empty((2, t.shape[0]), dtype=x.dtype)
        both[1] = xp.where(mine, e[rows, local], 0)  # the target's shifted logit, or 0
        xp.exp(e, out=e)
        both[0] = e.sum(axis=1)
        if comm.size > 1:
            comm.allreduce_(both)  # one call: the sum of exponentials and the target logit
        total, picked = both[0], both[1]
        nll = xp.log(total) - picked
        e /= total[:, None]
        self.probs, self.local, self.mine, self.valid, self.rows = e, local, mine, valid, rows
        if valid is not None:
            nll *= valid
        if self.reduction == "none":
            return nll.reshape(labels.shape).astype(out, copy=False)
        if self.reduction == "sum":
            return xp.asarray(nll.sum()).astype(out, copy=False)
        # On the device: reading the count back would cost a sync per step.
        self.count = xp.maximum(valid.sum(), 1).astype(x.dtype) if valid is not None \
            else max(t.shape[0], 1)
        return xp.asarray(nll.sum() / self.count).astype(out, copy=False)

    def backward(self, gy):
        xp = get_array_module(gy)
        if self.reduction == "none":
            coef = gy.reshape(-1).astype(self.probs.dtype)
        else:
            g = gy / self.count if self.reduction == "mean" else gy
            coef = xp.broadcast_to(xp.asarray(g).astype(self.probs.dtype), self.rows.shape)
        if self.valid is not None:
            coef = coef * self.valid
        g = self.probs * coef[:, None]
        hit = xp.nonzero(self.mine)[0]
        g[hit, self.local[hit]] -= coef[hit]
        return g.reshape(self.logits_shape).astype(self.dtype, copy=False), None


def vocab_parallel_cross_entropy(logits: Any, labels: Any, comm: Communicator, vocab_start: int,
                                 vocab: int, ignore_index: int | None = None,
                                 reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits whose class axis is split over ``comm``.

    As :func:`mpidl.functions.softmax_cross_entropy` on the full logits, but each rank
    holds ``logits`` ``(..., V_r)`` for classes ``[vocab_start, vocab_start + V_r)`` and
    the full labels; the result (and its gradient's scale) is the same on every rank.
    Collective over ``comm`` in forward (two allreduces of ``N`` and ``2N`` values).

    Args:
        logits: this rank's ``(..., V_r)``.
        labels: class ids in ``[0, vocab)`` of shape ``logits.shape[:-1]``, the same on
            every rank.
        comm: the tensor-parallel group.
        vocab_start: the first class of this rank's logits.
        vocab: the number of classes over all ranks.
        ignore_index, reduction: as :func:`~mpidl.functions.softmax_cross_entropy`.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}; use 'mean', 'sum' or 'none'")
    labels = as_input(labels)
    xp = get_array_module(logits)
    if get_array_module(labels) is not xp:
        labels = to_device(labels, xp)
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"vocab_parallel_cross_entropy: labels of shape {tuple(labels.shape)} "
                         f"do not match logits of shape {tuple(logits.shape)}")
    return VocabParallelCrossEntropy.apply(
        logits, labels, comm=comm, vocab_start=vocab_start, vocab=vocab,
        ignore_index=ignore_index, reduction=reduction, logits_shape=tuple(logits.shape))


def vocab_parallel_hits(logits: Any, labels: Any, comm: Communicator, vocab_start: int,
                        ignore_index: int | None = None) -> Any:
    """How many rows of logits split over the class axis (as
    :func:`vocab_parallel_cross_entropy` takes them) have their label as the argmax of
    the full row: the first of equal maxima, as ``argmax`` on the gathered logits. Rows
    labelled ``ignore_index`` count nothing. The same on every rank of ``comm``;
    collective over it (two allreduces of ``N`` values); no gradient."""
    data = as_input(logits)
    xp = get_array_module(data)
    x = data.reshape(-1, data.shape[-1])
    if x.dtype.itemsize < 4:  # exact widening: MPI has no float16 max everywhere
        x = x.astype(numpy.float32)
    t = to_device(as_input(labels), xp).reshape(-1)
    m = x.max(axis=1)
    if comm.size > 1:
        comm.allreduce_(m, op="max")
    at = x == m[:, None]
    none_here = numpy.iinfo(numpy.int64).max  # no maximum in this rank's classes
    first = xp.where(at.any(axis=1), at.argmax(axis=1).astype(numpy.int64) + vocab_start,
                     none_here)
    if comm.size > 1:
        comm.allreduce_(first, op="min")
    hit = first == t
    if ignore_index is not None:
        hit &= t != ignore_index
    return xp.count_nonzero(hit)  # left on the device: a step reads its sums once (#48)


__all__ = ["vocab_parallel_cross_entropy", "vocab_parallel_hits"]
