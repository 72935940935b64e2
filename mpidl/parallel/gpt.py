"""The small GPT on a process grid: tensor, Megatron-sequence, Ulysses and ring parallel.

    grid = ProcessGrid(world, tensor=2)                 # or sequence=2, or both
    model = parallel_gpt(grid, vocab=8000, seq_len=128, seed=0)
    dp = DataParallel(model, grid.replicas)
    loss = model.loss(ids, reduction="sum")             # ids: this data rank's (B, T + 1)
    dp.backward(loss, global_count=n_targets)

:class:`ParallelGPT` is built from a :class:`~mpidl.models.GPT` (the same on every rank:
built from one seed, or loaded from one checkpoint) and keeps this rank's shards, so its
parameters are exactly the single-rank model's, under the same names and in the same
order: :meth:`ParallelGPT.full_state_dict` is the single-rank model's state dict, from
any layout, and :meth:`ParallelGPT.load_full_state_dict` loads one into any layout.

Every rank of a tensor x sequence group is given the same full token ids (a few bytes
per token) and takes its own tokens. What a rank computes:

- the logits of its tokens (the sequence group's split) for its vocabulary rows (the
  tensor group's split), ``(B, T_r, V_r)``;
- its share of the loss: the sum over its tokens, the same on every rank of the tensor
  group; the shares of a sequence group add up to the sample's loss, and their
  gradients add up too, which is why data parallelism runs over
  :attr:`~mpidl.parallel.grid.ProcessGrid.replicas` (data x sequence).
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl import functions as F
from mpidl import models
from mpidl.autograd import Tensor
from mpidl.backend import get_array_module, to_device
from mpidl.models.gpt import GPT
from mpidl.nn.container import ModuleList
from mpidl.nn.linear import linear
from mpidl.nn.module import Module, as_input
from mpidl.parallel.grid import ProcessGrid
from mpidl.parallel.mappings import copy_to_region, gathered_linear
from mpidl.parallel.sequence import SequenceLayout
from mpidl.parallel.tensor import (ColumnParallelLinear, Shard, VocabParallelEmbedding,
                                   check_same_layer, full_state_dict, load_full_state_dict)
from mpidl.parallel.transformer import (ATTENTION, ParallelLayerNorm, ParallelTransformerLayer,
                                        Tokens)
from mpidl.parallel.vocab import vocab_parallel_cross_entropy, vocab_parallel_hits


class ParallelGPT(Module):
    """A :class:`~mpidl.models.GPT` split over the tensor and sequence axes of ``grid``.

    Construction is collective over the grid's tensor groups (the full parameters are
    compared across them).

    Args:
        gpt: the single-rank model, the same on every rank; its replicated parameters
            are taken over as they are, its split ones are copied into shards (the full
            model can be dropped afterwards).
        grid: the process grid.
        sequence_parallel: Megatron's sequence parallelism on the tensor group (LayerNorm
            and dropout regions split along the sequence; allgather/reduce-scatter in
            place of the allreduces). No effect on a tensor group of one rank.
        attention: how a sequence group of several ranks attends: "ring" (any head
            count; the causal sequence split zigzag so every rank has the same work) or
            "ulysses" (all-to-all; each tensor rank's heads divisible by the group).
    """

    def __init__(self, gpt: GPT, grid: ProcessGrid, *, sequence_parallel: bool = False,
                 attention: str = "ring") -> None:
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: use one of {ATTENTION}")
        tensor = grid.tensor
        sp = bool(sequence_parallel) and tensor.size > 1
        self.grid, self.sequence_parallel, self.attention = grid, sp, attention
        self.vocab, self.seq_len, self.tie_weights = gpt.vocab, gpt.seq_len, gpt.tie_weights
        self.pad_id = gpt.pad_id
        check_same_layer(tensor, "ParallelGPT (replicated parameters)", gpt.pos.data,
                         gpt.norm.weight.data, gpt.norm.bias.data)
        self.tok = VocabParallelEmbedding(gpt.tok, tensor, sequence_parallel=sp)
        self.pos = gpt.pos
        self.blocks = ModuleList(ParallelTransformerLayer(b, grid, sp, attention)
                                 for b in gpt.blocks)
        self.norm = ParallelLayerNorm(gpt.norm, tensor, sp)
        if not gpt.tie_weights:
            self.head = ColumnParallelLinear(gpt.head, tensor, partition=self.tok.partition,
                                             sequence_parallel=sp)

    # -- where the tokens are ---------------------------------------------------------------
    def layout(self, length: int) -> SequenceLayout:
        """How a ``length``-token input is split over this rank's sequence group."""
        seq = self.grid.sequence
        zigzag = self.attention == "ring" and seq.size > 1  # GPT attention is causal
        return SequenceLayout(length, seq.size, seq.rank, zigzag=zigzag)

    def tokens(self, length: int) -> Tokens:
        """The tokens of this rank's residual stream for a ``length``-token input."""
        return Tokens.of(self.layout(length), self.grid.tensor if self.sequence_parallel
                         else None)

    # -- forward --------------------------------------------------------------------------
    def forward(self, ids: Any) -> Tensor:
        """Full ids ``(B, T)`` (the same on the tensor x sequence group) -> this rank's
        logits ``(B, T_r, V_r)``: its tokens (:meth:`layout`), its vocabulary rows
        (``tok.vocab_start`` on). Collective over the tensor and sequence groups."""
        ids = as_input(ids)
        tokens = self.tokens(ids.shape[1])
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, tokens)
        return self.logits(x, ids.shape[1])

    def embed(self, ids: Any) -> Tensor:
        """Full ids ``(B, T)`` -> this rank's residual stream ``(B, T_here, D)`` (token
        and position embeddings of :meth:`tokens`). Collective over the tensor group."""
        ids = as_input(ids)
        length = ids.shape[1]
        if length > self.seq_len:
            raise ValueError(f"sequence length {length} exceeds the model's "
                             f"seq_len={self.seq_len}")
        tokens = self.tokens(length)
        x = self.tok(tokens.layout.split(ids, axis=1, fill=0))  # (B, T_here, D)
        pos = copy_to_region(self.grid.tensor, self.pos) if self.sequence_parallel \
            else self.pos
        rows = numpy.minimum(tokens.positions, length - 1)  # padding: any row
        if numpy.array_equal(rows, numpy.arange(length)):
            pos = pos if length == self.seq_len else F.getitem(pos, slice(0, length))
        else:
            pos = F.getitem(pos, to_device(rows, get_array_module(self.pos.data)))
        return F.add(x, pos)

    def logits(self, x: Any, length: int, weight: Any = None) -> Tensor:
        """The residual stream after the last block -> this rank's logits ``(B, T_r,
        V_r)`` of a ``length``-token input; ``weight``: the tied output weight to use
        in place of ``tok.weight`` (a pipeline's last stage receives it). Collective
        over the tensor group."""
        tensor = self.grid.tensor
        layout = self.layout(length)
        x = self.norm(x)
        if not self.tie_weights:
            return self.head(x, length=layout.shard_length)
        weight = self.tok.weight if weight is None else weight
        if self.sequence_parallel:
            return gathered_linear(tensor, x, weight, None, layout.shard_length)
        return linear(copy_to_region(tensor, x), weight)  # (B, T_r, V_r)

    def loss(self, ids: Any, reduction: str = "sum", hits: bool = False) -> Any:
        """This rank's share of the next-token cross-entropy of full ids ``(B, T + 1)``.

        ``"sum"``: the sum over this rank's targets (padding, of the data or of the
        layout, counts nothing); the same on every rank of the tensor group, and the
        shares of the sequence group add up to :meth:`GPT.loss`. ``"mean"``: that sum
        over the number of real targets of the whole input (:meth:`count_targets`), so
        the shares add up to the mean. ``"none"``: per token ``(B, T_r)``.
        ``hits``: return ``(loss, hits)``, hits this rank's share of the targets that are
        the argmax of their full logits (:func:`vocab_parallel_hits`; shared as the
        loss is: the sequence group's add up to the single-rank count).
        Collective over the tensor and sequence groups.
        """
        ids = as_input(ids)
        return self.loss_of_logits(self(ids[:, :-1]), ids, reduction, hits)

    def loss_of_logits(self, logits: Any, ids: Any, reduction: str = "sum",
                       hits: bool = False) -> Any:
        """:meth:`loss` of the logits :meth:`forward` gave for ``ids[:, :-1]``."""
        ids = as_input(ids)
        layout = self.layout(ids.shape[1] - 1)
        ignore = self.pad_id if self.pad_id is not None else (-1 if layout.has_padding else None)
        targets = layout.split(ids[:, 1:], axis=1, fill=0 if ignore is None else ignore)
        loss = vocab_parallel_cross_entropy(
            logits, targets, self.grid.tensor, self.vocab_start, self.vocab,
            ignore_index=ignore, reduction="sum" if reduction == "mean" else reduction)
        if reduction == "mean":
            loss = F.mul(loss, 1.0 / max(self.count_targets(ids), 1))
        if not hits:
            return loss
        return loss, vocab_parallel_hits(logits, targets, self.grid.tensor,
                                         self.vocab_start, ignore)

    @property
    def vocab_start(self) -> int:
        """The first vocabulary row of this tensor rank's logits."""
        return self.tok.vocab_start

    def count_targets(self, ids: Any) -> int:
        """How many next-token targets of the full ``ids`` count (not collective)."""
        return GPT.count_targets(self, ids)  # the single-rank rule: it reads pad_id only

    # -- full (single-rank) views -------------------------------------------------------------
    def gather_logits(self, logits: Any, length: int) -> Any:
        """The full ``(B, length, vocab)`` array from every rank's :meth:`forward` output.

        Collective over the tensor and sequence groups.
        """
        data = as_input(logits)
        full = Shard(data.ndim - 1, self.tok.partition, self.grid.tensor).gather(data)
        return self.layout(length).gather(full, self.grid.sequence, axis=1)

    def full_state_dict(self) -> dict[str, Any]:
        """The single-rank model's state dict; collective (see :func:`full_state_dict`)."""
        return full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Load a single-rank state dict into this layout (not collective)."""
        load_full_state_dict(self, state, strict)

    def extra_repr(self) -> str:
        g = self.grid
        return (f"tensor={g.tensor_size}, sequence={g.sequence_size}, "
                f"sequence_parallel={self.sequence_parallel}, attention={self.attention!r}")


def parallel_gpt(grid: ProcessGrid, *, sequence_parallel: bool = False, attention: str = "ring",
                 **gpt_kwargs: Any) -> ParallelGPT:
    """:func:`mpidl.models.gpt` (same arguments, same seed, same parameters) on ``grid``.

    Every rank builds the full model from the seed, then keeps its shards: the gathered
    parameters equal the single-rank model's exactly. Collective as :class:`ParallelGPT`.
    """
    return ParallelGPT(models.gpt(**gpt_kwargs), grid, sequence_parallel=sequence_parallel,
                       attention=attention)


__all__ = ["ParallelGPT", "parallel_gpt"]
