"""The transformer layer with its weights split over a tensor group and its tokens over
a sequence group, built from the single-rank :class:`~mpidl.nn.TransformerEncoderLayer`.

Parameter names and order are those of the single-rank layer (``norm1.weight``,
``self_attn.in_proj.weight``, ...), so a full state dict of the parallel model is the
single-rank model's state dict.

Where the tokens are: a sequence group of ``s`` ranks splits the sequence by a
:class:`~mpidl.parallel.sequence.SequenceLayout`, and with Megatron's sequence
parallelism a tensor group of ``t`` further splits each rank's share into
``split_counts(T_r, t)`` pieces outside the column/row pairs. :class:`Tokens` carries both
to every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.backend import get_array_module
from mpidl.comm.base import Communicator, split_counts
from mpidl.functions.dropout import _uniform  # the very draw F.dropout makes
from mpidl.nn.attention import MultiHeadAttention, merge_heads, split_heads
from mpidl.nn.dropout import Dropout
from mpidl.nn.module import Module
from mpidl.nn.norm import LayerNorm
from mpidl.nn.recompute import check_recompute, checkpoint
from mpidl.nn.transformer import TransformerEncoderLayer
from mpidl.parallel.grid import ProcessGrid
from mpidl.parallel.mappings import copy_to_region
from mpidl.parallel.ring import ring_attention
from mpidl.parallel.sequence import SequenceLayout, ulysses_attention, ulysses_heads_fit
from mpidl.parallel.tensor import ColumnParallelLinear, RowParallelLinear, shard_counts

ATTENTION = ("ring", "ulysses")


@dataclass(frozen=True)
class Tokens:
    """The tokens this rank works on.

    Attributes:
        layout: the sequence split over the sequence group (attention sees its shard).
        positions: positions (in the padded sequence) of the tokens of this rank's
            residual stream: the layout's shard, or with Megatron sequence parallelism
            this tensor rank's piece of it.
        length: the real length of the whole sequence.
    """

    layout: SequenceLayout
    positions: numpy.ndarray
    length: int

    @classmethod
    def of(cls, layout: SequenceLayout, tensor: Communicator | None) -> "Tokens":
        """The tokens of this rank; ``tensor``: split them for sequence parallelism."""
        positions = layout.positions()
        if tensor is not None and tensor.size > 1:
            counts = split_counts(layout.shard_length, tensor.size)
            start = sum(counts[:tensor.rank])
            positions = positions[start:start + counts[tensor.rank]]
        return cls(layout, positions, layout.length)


class ParallelLayerNorm(Module):
    """A LayerNorm whose parameters are the single-rank ones, replicated over the group.

    Inside a sequence-parallel region each rank normalises only its tokens, so its
    weight and bias gradients are partial sums: they pass through ``copy_to_region``,
    whose backward adds them up over the tensor group.
    """

    def __init__(self, norm: LayerNorm, comm: Communicator, sequence_parallel: bool) -> None:
        super().__init__()
        self.comm, self.sequence_parallel, self.eps = comm, sequence_parallel, norm.eps
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x: Any) -> Tensor:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = None if w is None else copy_to_region(self.comm, w)
            b = None if b is None else copy_to_region(self.comm, b)
        return F.layer_norm(x, w, b, eps=self.eps)


class ShardedDropout(Module):
    """The single-rank model's dropout on this rank's tokens.

    Every rank draws the whole ``(B, T, D)`` mask from the same generator (the
    single-rank layer's, so its state advances alike everywhere and checkpoints as
    before) and keeps the rows of its tokens: the masks are those of the single-rank
    model, never the same pattern repeated on every shard. The price is the draw of the
    full mask on every rank (compute, not memory that outlives the call).
    """

    def __init__(self, dropout: Dropout) -> None:
        super().__init__()
        self.p, self.rng = dropout.p, dropout.rng

    def forward(self, x: Any, tokens: Tokens) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        xp = get_array_module(x.data)
        b, _, d = x.shape
        keep = _uniform(self.rng, (b, tokens.length, d), xp) >= self.p
        rows = numpy.minimum(tokens.positions, tokens.length - 1)  # padding: any row
        if not numpy.array_equal(rows, numpy.arange(tokens.length)):
            keep = keep[:, xp.asarray(rows)]
        mask = keep.astype(x.dtype)
        mask *= x.dtype.type(1.0 / (1.0 - self.p))
        return F.mul(x, mask)


class ParallelSelfAttention(Module):
    """Multi-head self-attention with its heads split over the tensor group and its
    sequence over the sequence group (Ulysses or ring attention).

    Args:
        attn: the single-rank layer, the same on every rank.
        grid: the process grid.
        sequence_parallel: Megatron's sequence parallelism on the tensor group.
        attention: "ring" or "ulysses", how the sequence group attends.
    """

    def __init__(self, attn: MultiHeadAttention, grid: ProcessGrid, sequence_parallel: bool,
                 attention: str) -> None:
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: use one of {ATTENTION}")
        tensor, seq = grid.tensor, grid.sequence
        heads = shard_counts(attn.heads, tensor, "heads")
        if attention == "ulysses" and not ulysses_heads_fit(attn.heads, tensor.size, seq.size):
            raise ValueError(
                f"Ulysses attention splits each tensor rank's heads {list(heads)} over the "
                f"sequence group of {seq.size}, which does not divide them; use "
                "attention='ring', or heads divisible by tensor x sequence")
        dh = attn.dim // attn.heads
        self.causal, self.attention, self.sequence = attn.causal, attention, seq
        self.heads = heads[tensor.rank]
        width = [h * dh for h in heads]
        self.in_proj = ColumnParallelLinear(attn.in_proj, tensor, partition=width, groups=3,
                                            sequence_parallel=sequence_parallel)
        self.out_proj = RowParallelLinear(attn.out_proj, tensor, partition=width,
                                          sequence_parallel=sequence_parallel)

    def forward(self, x: Any, tokens: Tokens, keep_probs: bool = True) -> Tensor:
        """``keep_probs=False``: selective recomputation of the attention probabilities
        (ring attention keeps none in any case: it recomputes them block by block)."""
        layout = tokens.layout
        qkv = self.in_proj(x, length=layout.shard_length)  # (B, T_r, 3 H_t dh)
        if self.attention == "ulysses" or self.sequence.size == 1:
            y = ulysses_attention(qkv, self.sequence, self.heads, self.causal, layout,
                                  keep_probs=keep_probs)
        else:
            q, k, v = split_heads(qkv, self.heads)
            y = merge_heads(ring_attention(q, k, v, self.sequence, layout, self.causal))
        return self.out_proj(y)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, causal={self.causal}, attention={self.attention!r}"


class ParallelTransformerLayer(Module):
    """:class:`~mpidl.nn.TransformerEncoderLayer` on a process grid: the attention half and
    the MLP half each one column-parallel and one row-parallel layer (one allreduce per
    half in forward and one in backward, or with ``sequence_parallel`` an allgather and a
    reduce-scatter each), attention over the sequence group.

    Args:
        layer: the single-rank layer, the same on every rank (its parameters are
            compared, then this rank keeps its shards and the replicated parameters
            themselves).
        grid, sequence_parallel, attention: as :class:`ParallelSelfAttention`.
        recompute: ``"none"``, ``"selective"`` or ``"full"`` (:mod:`mpidl.nn.recompute`);
            None: the single-rank layer's. With ``"full"`` the forward collectives run
            again in backward, in the same order on every rank.
    """

    def __init__(self, layer: TransformerEncoderLayer, grid: ProcessGrid,
                 sequence_parallel: bool = False, attention: str = "ring",
                 recompute: str | None = None) -> None:
        super().__init__()
        tensor = grid.tensor
        self.approximate = layer.approximate
        self.recompute = check_recompute(layer.recompute if recompute is None else recompute)
        self.norm1 = ParallelLayerNorm(layer.norm1, tensor, sequence_parallel)
        self.self_attn = ParallelSelfAttention(layer.self_attn, grid, sequence_parallel,
                                               attention)
        self.norm2 = ParallelLayerNorm(layer.norm2, tensor, sequence_parallel)
        hidden = shard_counts(layer.linear1.out_features, tensor, "ffn")
        self.linear1 = ColumnParallelLinear(layer.linear1, tensor, partition=hidden,
                                            sequence_parallel=sequence_parallel)
        self.linear2 = RowParallelLinear(layer.linear2, tensor, partition=hidden,
                                         sequence_parallel=sequence_parallel)
        self.dropout1 = None if layer.dropout1 is None else ShardedDropout(layer.dropout1)
        self.dropout2 = None if layer.dropout2 is None else ShardedDropout(layer.dropout2)

    def forward(self, x: Any, tokens: Tokens) -> Tensor:
        """``x`` ``(B, T_here, D)``, this rank's tokens (``tokens.positions``) -> the same."""
        if check_recompute(self.recompute) == "full":
            return checkpoint(lambda t: self._forward(t, tokens), x, self)
        return self._forward(x, tokens)

    def _forward(self, x: Any, tokens: Tokens) -> Tensor:
        a = self.self_attn(self.norm1(x), tokens, keep_probs=self.recompute != "selective")
        if self.dropout1 is not None:
            a = self.dropout1(a, tokens)
        h = F.add(x, a)
        u = self.linear1(self.norm2(h), length=tokens.layout.shard_length)
        f = self.linear2(F.gelu(u, approximate=self.approximate))
        if self.dropout2 is not None:
            f = self.dropout2(f, tokens)
        return F.add(h, f)


__all__ = ["Tokens", "ParallelLayerNorm", "ShardedDropout", "ParallelSelfAttention",
           "ParallelTransformerLayer", "ATTENTION"]
