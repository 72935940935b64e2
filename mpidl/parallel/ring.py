"""Ring attention: blockwise attention with an online softmax, K/V passed around a ring.

Each rank of a sequence group of ``s`` holds its tokens' q, k and v ``(B, H, T_r, dh)``.
In ``s`` steps every key/value block visits every rank: at step ``i`` rank ``r``
computes its queries against the block of rank ``r - i`` while that block is already on
its way to ``r + 1`` (:meth:`~mpidl.comm.mpi.MpiCommunicator.isendrecv`, polled between
the block's matrix products: Open MPI moves a large message only inside MPI calls).
Block results are merged with the log-sum-exp of each query row, in the logsigmoid form
of ring-flash-attention (``_update_out_and_lse``; the plain ``log(1 + exp(.))`` overflowed
there, their PRs #30 and #34)::

    lse' = lse - logsigmoid(lse - lse_b)       out' = out - sigmoid(lse_b - lse) (out - out_b)

in float32 at least (float64 inputs stay float64).

Backward recomputes each block's probabilities from the *global* output and log-sum-exp
saved by forward (FlashAttention's recomputation: no ``T x T`` array outlives a step).
dQ accumulates locally; dK/dV of the visiting block accumulate in a buffer that travels
the ring behind the block and is sent at every step, the last included, so after ``s``
hops it is back at the block's owner holding every rank's contribution.

Which (query, key) pairs a step computes follows from the positions of the two blocks
(:class:`~mpidl.parallel.sequence.SequenceLayout`): a block pair that causality or
padding hides entirely is skipped, and a step computes only the rows and columns that
see something. With the zigzag layout that gives ring-flash-attention's balanced
schedule by itself: at step 0 the local causal block; from a rank before this one, both
query chunks against its early chunk; from a rank after it, the late query chunk
against both of its chunks: every step the same ``2 c x c`` work on every rank.

Traffic per layer and rank: forward ``s - 1`` K/V blocks of ``2 B H T_r dh`` values;
backward ``s - 1`` K/V blocks again and ``s`` dK/dV blocks of the same size (in the
accumulation dtype).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, to_device
from mpidl.comm.base import Communicator
from mpidl.functions.math import sum_last_axis
from mpidl.parallel.sequence import SequenceLayout


def _block_plan(layout: SequenceLayout, causal: bool, me: int, src: int) -> Any:
    """``(rows, cols, keep)`` of the queries of ``me`` against the keys of ``src``.

    ``rows``/``cols`` are slices of the two blocks that hold every visible pair, ``keep``
    the boolean mask within them (None: all visible); None when nothing is visible.
    """
    keep = numpy.broadcast_to(layout.valid(src)[None, :], (layout.shard_length,) * 2)
    if causal:
        keep = keep & (layout.positions(src)[None, :] <= layout.positions(me)[:, None])
    rows, cols = numpy.nonzero(keep.any(axis=1))[0], numpy.nonzero(keep.any(axis=0))[0]
    if rows.size == 0:
        return None
    rows, cols = slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
    keep = keep[rows, cols]
    return rows, cols, (None if keep.all() else numpy.ascontiguousarray(keep))


def _block_forward(q: Any, k: Any, v: Any, scale: Any, keep: Any,
                   poll: Callable[[], Any]) -> tuple[Any, Any]:
    """Attention of ``q`` over one key block: its output and the rows' log-sum-exp."""
    xp = get_array_module(q)
    s = xp.matmul(q * scale, xp.swapaxes(k, -1, -2))  # (B, H, m, n)
    poll()
    if keep is not None:
        xp.copyto(s, xp.finfo(s.dtype).min, where=xp.logical_not(keep))
    m = s.max(axis=-1, keepdims=True)
    s -= m
    p = xp.exp(s, out=s)
    total = sum_last_axis(p)  # (B, H, m, 1)
    poll()
    o = xp.matmul(p, v)
    o /= total
    lse = (m + xp.log(total))[..., 0]
    if keep is not None:  # a row that sees no key of this block contributes nothing
        empty = xp.logical_not(keep.any(axis=-1))
        lse[..., empty] = -xp.inf
        o[..., empty, :] = 0
    return o, lse


def _block_backward(q: Any, k: Any, v: Any, do: Any, lse: Any, delta: Any, scale: Any,
                    keep: Any, poll: Callable[[], Any]) -> tuple[Any, Any, Any]:
    """dQ, dK, dV of one block, from the global log-sum-exp and ``delta = rowsum(dO O)``."""
    xp = get_array_module(q)
    s = xp.matmul(q * scale, xp.swapaxes(k, -1, -2))
    poll()
    if keep is not None:
        xp.copyto(s, xp.finfo(s.dtype).min, where=xp.logical_not(keep))
    # A row that saw no key anywhere has lse = -inf: its probabilities are 0, not NaN.
    s -= xp.where(xp.isneginf(lse), xp.inf, lse)[..., None]
    p = xp.exp(s, out=s)
    dv = xp.matmul(xp.swapaxes(p, -1, -2), do)
    dp = xp.matmul(do, xp.swapaxes(v, -1, -2))
    poll()
    dp -= delta[..., None]
    dp *= p  # dS
    dq = xp.matmul(dp, k)
    dq *= scale
    dk = xp.matmul(xp.swapaxes(dp, -1, -2), q)
    dk *= scale
    return dq, dk, dv


def _logsigmoid(xp: Any, x: Any) -> Any:
    return xp.minimum(x, 0) - xp.log1p(xp.exp(-xp.abs(x)))


def _merge(out: Any, lse: Any, o_b: Any, lse_b: Any) -> None:
    """Fold one block's ``(o_b, lse_b)`` into the running ``(out, lse)``, in place."""
    xp = get_array_module(out)
    fresh, empty = xp.isneginf(lse), xp.isneginf(lse_b)  # nothing seen yet / in the block
    d = xp.where(fresh | empty, 0, lse - lse_b)
    w = xp.where(empty, 0, xp.where(fresh, 1, xp.exp(_logsigmoid(xp, -d))))  # sigmoid(-d)
    merged = xp.where(empty, lse, xp.where(fresh, lse_b, lse - _logsigmoid(xp, d)))
    out -= w[..., None] * (out - o_b)
    lse[...] = merged


def _no_poll() -> None:
    pass


def _poller(*requests: Any) -> Callable[[], None]:
    """A function that progresses the requests in flight (Open MPI moves a large message
    only inside MPI calls, so the block compute calls it between its products)."""
    live = [r for r in requests if r is not None]
    if not live:
        return _no_poll

    def poll() -> None:
        for r in live:
            r.test()

    return poll


class RingAttention(Function):
    def _plans(self) -> list:
        s, me = self.comm.size, self.comm.rank
        plans = [_block_plan(self.layout, self.causal, me, (me - i) % s) for i in range(s)]
        return [None if p is None else
                (p[0], p[1], None if p[2] is None else to_device(p[2], self.xp)) for p in plans]

    def _exchange(self, x: Any, step: int) -> Any:
        s, me = self.comm.size, self.comm.rank
        if step >= s - 1:
            return None
        return self.comm.isendrecv(x, dest=(me + 1) % s, source=(me - 1) % s)

    def forward(self, q, k, v):
        xp = self.xp = get_array_module(q)
        acc = numpy.promote_types(q.dtype, numpy.float32)
        self.scale = acc.type(1.0 / math.sqrt(q.shape[-1]))
        self.plans = self._plans()
        dh = k.shape[-1]
        b, h, t, dv = v.shape
        out = xp.zeros((b, h, t, dv), dtype=acc)
        lse = xp.full((b, h, t), -xp.inf, dtype=acc)
        kv = xp.concatenate([k, v], axis=-1).astype(acc, copy=False)  # travels as one block
        qa = q.astype(acc, copy=False)
        for step, plan in enumerate(self.plans):
            req = self._exchange(kv, step)
            if plan is not None:
                rows, cols, keep = plan
                o_b, lse_b = _block_forward(qa[:, :, rows], kv[:, :, cols, :dh],
                                            kv[:, :, cols, dh:], self.scale, keep,
                                            _poller(req))
                _merge(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
            if req is not None:
                kv = req.wait()
        self.q, self.k, self.v, self.out, self.lse = q, k, v, out, lse
        return out.astype(q.dtype, copy=False)

    def backward(self, do):
        xp, acc = self.xp, self.out.dtype
        q, k, v = self.q, self.k, self.v
        dh = k.shape[-1]
        do = do.astype(acc, copy=False)
        delta = xp.einsum("...i,...i->...", do, self.out)  # (B, H, T_r)
        qa = q.astype(acc, copy=False)
        dq = xp.zeros(q.shape, dtype=acc)
        kv = xp.concatenate([k, v], axis=-1).astype(acc, copy=False)
        travelling = None  # the dK/dV buffer on its way round
        for step, plan in enumerate(self.plans):
            req = self._exchange(kv, step)
            poll = _poller(req, travelling)  # both move while this block computes
            mine = xp.zeros(kv.shape, dtype=acc)
            if plan is not None:
                rows, cols, keep = plan
                dq_b, dk_b, dv_b = _block_backward(
                    qa[:, :, rows], kv[:, :, cols, :dh], kv[:, :, cols, dh:], do[:, :, rows],
                    self.lse[:, :, rows], delta[:, :, rows], self.scale, keep, poll)
                dq[:, :, rows] += dq_b
                mine[:, :, cols, :dh] += dk_b
                mine[:, :, cols, dh:] += dv_b
            if travelling is not None:
                mine += travelling.wait()
            if self.comm.size > 1:  # every step, the last included: back to the owner
                s, me = self.comm.size, self.comm.rank
                travelling = self.comm.isendrecv(mine, dest=(me + 1) % s, source=(me - 1) % s)
            if req is not None:
                kv = req.wait()
        dkv = travelling.wait() if travelling is not None else mine
        return (dq.astype(q.dtype, copy=False), dkv[..., :dh].astype(k.dtype),
                dkv[..., dh:].astype(v.dtype))


def ring_attention(q: Any, k: Any, v: Any, comm: Communicator, layout: SequenceLayout,
                   causal: bool = False) -> Tensor:
    """Attention of a sequence split over ``comm``, by ring (see the module docstring).

    Args:
        q, k, v: this rank's tokens, ``(B, H, T_r, dh)`` (v may have another last size).
        comm: the sequence group.
        layout: where each rank's tokens sit (its ``size`` is ``comm.size``;
            ``zigzag=True`` balances causal work); padded positions are never attended.
        causal: position i attends to positions <= i of the whole sequence.

    Returns:
        ``(B, H, T_r, dv)`` for this rank's queries, as full attention would give them.

    Collective over ``comm`` in forward and backward (point-to-point around the ring:
    every rank must call it, in the same order as its other calls on ``comm``).
    """
    if layout.size != comm.size or layout.rank != comm.rank:
        raise ValueError(f"ring_attention: layout {layout} is not for rank {comm.rank} of "
                         f"a group of {comm.size}")
    if q.shape[-2] != layout.shard_length or k.shape[-2] != layout.shard_length:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must "
                         f"hold this rank's {layout.shard_length} tokens (axis -2)")
    return RingAttention.apply(q, k, v, comm=comm, layout=layout, causal=causal)


__all__ = ["ring_attention"]
