"""Sequence parallelism: a sequence split across a group, and Ulysses attention over it.

Every rank of a sequence group holds the same samples and parameters but only some of
the tokens. Everything a transformer does per token (embeddings, LayerNorm, the MLP,
the loss) then runs on those tokens alone; only attention mixes tokens, and there are
two ways to give each query the keys it needs:

- **Ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses), :func:`ulysses_attention`: one
  all-to-all turns the sequence-sharded q, k, v into head-sharded ones (every rank gets
  the whole sequence for ``H / s`` heads), attention runs locally, and a second
  all-to-all turns the output back. Per layer and pass ``4 B T D / s`` values leave
  each rank (q, k, v and the output); needs ``H % s == 0``.
- **Ring** (Liu et al. 2023), :func:`mpidl.parallel.ring.ring_attention`: the key/value
  blocks travel around the ring while each rank computes its queries against the block
  it holds. ``s - 1`` block exchanges per pass, any head count, and no rank ever holds
  more than its own and one visiting block.

:class:`SequenceLayout` says which tokens a rank holds. Contiguous by default; with
``zigzag=True`` (causal ring attention) the sequence is cut into ``2 s`` chunks and rank
``r`` holds chunks ``r`` and ``2 s - 1 - r``, one early and one late, so every rank has
the same causal work (ring-flash-attention's zigzag; Megatron's
``get_batch_on_this_cp_rank``). A length the layout cannot cut evenly is padded at the
end; padded positions are masked out of attention as keys and get no loss, so they
never change a real token's result.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy

from mpidl import functions as F
from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, to_device
from mpidl.comm.base import Communicator, split_counts
from mpidl.nn.attention import merge_heads, split_heads


class SequenceLayout:
    """Which positions of a ``length``-token sequence each of ``size`` ranks holds.

    The sequence is padded at the end to ``padded`` tokens (a multiple of ``size``, of
    ``2 size`` when ``zigzag``); every rank holds ``shard_length = padded / size``.

    Args:
        length: the real number of tokens.
        size: ranks in the sequence group.
        rank: this rank (the default for the ``rank=`` arguments below).
        zigzag: rank r holds chunks r and 2 size - 1 - r of 2 size (causal balance).
    """

    def __init__(self, length: int, size: int, rank: int = 0, zigzag: bool = False) -> None:
        if length < 1 or size < 1 or not 0 <= rank < size:
            raise ValueError(f"SequenceLayout(length={length}, size={size}, rank={rank}): "
                             "need length >= 1, size >= 1 and 0 <= rank < size")
        self.length, self.size, self.rank, self.zigzag = length, size, rank, zigzag
        parts = 2 * size if zigzag else size
        self.chunk = -(-length // parts)  # tokens per chunk
        self.padded = self.chunk * parts
        self.shard_length = self.padded // size

    @property
    def has_padding(self) -> bool:
        return self.padded != self.length

    def positions(self, rank: int | None = None) -> numpy.ndarray:
        """The positions (in the padded sequence) of ``rank``'s tokens, in its order."""
        r = self.rank if rank is None else rank
        c = self.chunk
        if not self.zigzag:
            return numpy.arange(r * self.shard_length, (r + 1) * self.shard_length)
        late = 2 * self.size - 1 - r
        return numpy.concatenate([numpy.arange(r * c, (r + 1) * c),
                                  numpy.arange(late * c, (late + 1) * c)])

    def valid(self, rank: int | None = None) -> numpy.ndarray:
        """True for ``rank``'s real tokens, False for padding."""
        return self.positions(rank) < self.length

    def split(self, x: Any, axis: int = 1, fill: Any = 0, rank: int | None = None) -> Any:
        """``rank``'s tokens of ``x`` (the full sequence along ``axis``), padding = ``fill``.

        Not collective: every rank of the group holds the whole (small) input, such as
        the token ids of the batch.
        """
        xp = get_array_module(x)
        if x.shape[axis] != self.length:
            raise ValueError(f"SequenceLayout.split: axis {axis} of shape {tuple(x.shape)} "
                             f"has {x.shape[axis]} tokens; this layout is for {self.length}")
        pos = self.positions(rank)
        idx = numpy.minimum(pos, self.length - 1)
        out = xp.take(x, to_device(idx, xp), axis=axis)
        if self.has_padding:
            pad = [slice(None)] * x.ndim
            pad[axis] = to_device(numpy.nonzero(pos >= self.length)[0], xp)
            out[tuple(pad)] = fill
        return out

    def unsplit(self, parts: Sequence[Any], axis: int = 1) -> Any:
        """The full sequence from every rank's part (``parts[r]`` from rank r), unpadded."""
        xp = get_array_module(parts[0])
        order = numpy.concatenate([self.positions(r) for r in range(self.size)])
        joined = xp.concatenate(list(parts), axis=axis)
        inverse = numpy.argsort(order)[: self.length]
        return xp.take(joined, to_device(inverse, xp), axis=axis)

    def gather(self, x: Any, comm: Communicator, axis: int = 1) -> Any:
        """The full sequence from this rank's part ``x``. Collective over ``comm``."""
        if comm.size == 1:
            return self.unsplit([x], axis)
        xp = get_array_module(x)
        stacked = comm.allgather(xp.ascontiguousarray(x))
        return self.unsplit([stacked[r] for r in range(comm.size)], axis)

    def __repr__(self) -> str:
        return (f"SequenceLayout(length={self.length}, size={self.size}, rank={self.rank}, "
                f"zigzag={self.zigzag}, padded={self.padded})")


def zigzag_split(x: Any, size: int, rank: int, axis: int = 1, fill: Any = 0) -> Any:
    """Rank ``rank``'s two chunks (``rank`` and ``2 size - 1 - rank``) of ``x`` along ``axis``."""
    return SequenceLayout(x.shape[axis], size, rank, zigzag=True).split(x, axis, fill)


def zigzag_unsplit(parts: Sequence[Any], length: int, axis: int = 1) -> Any:
    """The inverse of :func:`zigzag_split`: the ``length``-token sequence from every part."""
    return SequenceLayout(length, len(parts), 0, zigzag=True).unsplit(parts, axis)


# -- Ulysses -------------------------------------------------------------------------------
class SequenceToHeads(Function):
    """``(B, T_r, 3 H dh)`` this rank's tokens -> q, k, v ``(B, H / s, T, dh)`` its heads."""

    def forward(self, qkv):
        s, hs = self.comm.size, self.heads // self.comm.size
        b, t, width = qkv.shape
        dh = width // (3 * self.heads)
        # Block j of the all-to-all (axis 0) must hold head group j: MPI sends contiguous
        # block j to rank j, so the head groups lead.
        x = qkv.reshape(b, t, 3, s, hs, dh).transpose(3, 2, 0, 4, 1, 5)  # (s, 3, B, hs, T_r, dh)
        y = self.comm.alltoall(x)  # y[i]: rank i's tokens of my heads, in sequence order
        y = y.transpose(1, 2, 3, 0, 4, 5).reshape(3, b, hs, s * t, dh)
        return y[0], y[1], y[2]

    def backward(self, gq, gk, gv):
        xp = get_array_module(*(g for g in (gq, gk, gv) if g is not None))
        like = next(g for g in (gq, gk, gv) if g is not None)
        s = self.comm.size
        b, hs, full, dh = like.shape
        t = full // s
        g = xp.empty((3, b, hs, s, t, dh), dtype=like.dtype)
        for i, gi in enumerate((gq, gk, gv)):
            g[i] = 0 if gi is None else gi.reshape(b, hs, s, t, dh)
        y = self.comm.alltoall(g.transpose(3, 0, 1, 2, 4, 5))  # (s heads, 3, B, hs, T_r, dh)
        return y.transpose(2, 4, 1, 0, 3, 5).reshape(b, t, 3 * s * hs * dh)


class HeadsToSequence(Function):
    """``(B, H / s, T, dh)`` this rank's heads -> ``(B, T_r, H dh)`` its tokens, heads merged."""

    def forward(self, y):
        s = self.comm.size
        b, hs, full, dh = y.shape
        t = full // s
        x = self.comm.alltoall(y.reshape(b, hs, s, t, dh).transpose(2, 0, 3, 1, 4))
        return x.transpose(1, 2, 0, 3, 4).reshape(b, t, s * hs * dh)  # (B, T_r, H dh)

    def backward(self, gy):
        s = self.comm.size
        b, t, width = gy.shape
        hs = self.heads // s
        dh = width // self.heads
        g = self.comm.alltoall(gy.reshape(b, t, s, hs, dh).transpose(2, 0, 1, 3, 4))
        return g.transpose(1, 3, 0, 2, 4).reshape(b, hs, s * t, dh)


def ulysses_heads_fit(heads: int, tensor: int = 1, sequence: int = 1) -> bool:
    """Whether Ulysses attention can split ``heads`` heads: over ``tensor`` ranks in
    near-equal shares (:func:`~mpidl.comm.base.split_counts`), and each share over the
    ``sequence`` ranks of a sequence group, every one of which needs whole heads.

    The one statement of the rule: the layout planner, the parallel attention layer,
    this module's attention and the planner's cost model all ask here.
    """
    return all(h % sequence == 0 for h in split_counts(heads, tensor))


def ulysses_attention(qkv: Any, comm: Communicator, heads: int, causal: bool,
                      layout: SequenceLayout, keep_probs: bool = True) -> Tensor:
    """Self-attention of a sequence split over ``comm``, by two all-to-alls (Ulysses).

    Args:
        qkv: this rank's tokens' fused projection ``(B, T_r, 3 H dh)`` (q, k, v, each
            head-major, as :func:`mpidl.nn.attention.split_heads` reads it).
        comm: the sequence group; ``heads % comm.size`` must be 0.
        heads: H, the heads in ``qkv``.
        causal: causal attention over the positions of the whole sequence.
        layout: a contiguous :class:`SequenceLayout` of the sequence over ``comm``;
            padded positions are masked out as keys.
        keep_probs: False recomputes the attention probabilities in backward
            (selective recomputation, :mod:`mpidl.nn.recompute`).

    Returns:
        ``(B, T_r, H dh)``, this rank's tokens, heads merged (ready for ``out_proj``).

    Collective over ``comm`` in forward and backward: four all-to-alls in all.
    """
    if not ulysses_heads_fit(heads, sequence=comm.size):
        raise ValueError(f"Ulysses attention splits heads over the sequence group: "
                         f"heads={heads} is not divisible by {comm.size} ranks; use ring "
                         "attention, or a head count that the group size divides")
    if layout.zigzag or layout.size != comm.size:
        raise ValueError(f"ulysses_attention needs a contiguous layout over {comm.size} ranks, "
                         f"got {layout}")
    mask = None
    if layout.has_padding:
        xp = get_array_module(qkv)
        mask = to_device(numpy.arange(layout.padded) < layout.length, xp)[None, None, None]
    if comm.size == 1:
        q, k, v = split_heads(qkv, heads)
        return merge_heads(F.scaled_dot_product_attention(q, k, v, causal=causal, mask=mask,
                                                          keep_probs=keep_probs))
    q, k, v = SequenceToHeads.apply(qkv, comm=comm, heads=heads)
    y = F.scaled_dot_product_attention(q, k, v, causal=causal, mask=mask,
                                       keep_probs=keep_probs)  # (B, H/s, T, dh)
    return HeadsToSequence.apply(y, comm=comm, heads=heads)


__all__ = ["SequenceLayout", "zigzag_split", "zigzag_unsplit", "ulysses_attention"]
