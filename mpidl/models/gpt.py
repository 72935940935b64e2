"""A small GPT: a causal transformer language model (Radford et al. 2019; nanoGPT's layout)."""
from __future__ import annotations

import contextlib
from typing import Any, Container

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn import init
from mpidl.nn.container import ModuleList
from mpidl.nn.embedding import Embedding
from mpidl.nn.linear import Linear, linear
from mpidl.nn.module import Module, Parameter, as_input, default_dtype
from mpidl.nn.norm import LayerNorm
from mpidl.nn.recompute import set_recompute
from mpidl.nn.transformer import TransformerEncoderLayer


class GPT(Module):
    """Token + position embeddings, causal pre-LN blocks, final LayerNorm, output projection.

    ids ``(B, T)`` with ``T <= seq_len`` -> next-token logits ``(B, T, vocab)``. By default
    the output projection is the token embedding's transpose (weight tying, Press & Wolf
    2017), so the table is one parameter, ``tok.weight``; its gradient is then dense (every
    row gets one from the output layer), so sparse embedding-gradient exchange must not
    be used for it. ``tie_weights=False`` adds a separate ``head.weight`` ``(vocab, D)``.
    Embeddings start as N(0, 0.02²), GPT-2's scale; the blocks use GELU's tanh form as
    GPT-2 does.

    Args:
        vocab: vocabulary size.
        seq_len: context length (number of learned positions).
        dim: model width.
        layers: number of blocks.
        heads: attention heads per block.
        ffn: feed-forward hidden width (default ``4 * dim``).
        dropout: residual-branch dropout.
        tie_weights: share the token embedding with the output projection.
        pad_id: the padding token id: :meth:`loss` gives padded targets no loss (and no
            gradient), so padding is never something to predict. None: every target
            counts.
        recompute: ``"none"``, ``"selective"`` or ``"full"``: what the blocks recompute
            in backward instead of keeping (:mod:`mpidl.nn.recompute`; the gradients
            are the same); :meth:`set_recompute` changes it on a built model.
        seed, rng, dtype: see :mod:`mpidl.nn.init`; float32 by default.
        keep: which of ``tok``, ``pos``, ``blocks.<i>``, ``norm``, ``head`` this process
            holds (a pipeline stage's: :func:`~mpidl.parallel.pipeline_gpt.stage_keeps`);
            the rest are built under :func:`mpidl.nn.init.skipped`: placeholders of no
            memory, their values drawn and dropped, so the kept ones equal the whole
            build's. None: all of them.
    """

    def __init__(self, vocab: int = 8000, seq_len: int = 128, dim: int = 128, layers: int = 2,
                 heads: int = 4, ffn: int | None = None, dropout: float = 0.0,
                 tie_weights: bool = True, pad_id: int | None = None,
                 recompute: str = "none", *,
                 seed: int | None = None, rng: numpy.random.Generator | None = None,
                 dtype: Any = None, keep: Container[str] | None = None) -> None:
        super().__init__()
        rng = init.make_rng(seed, rng)
        dtype = default_dtype(dtype)

        def kept(name: str) -> Any:  # a whole build draws and keeps everything
            return contextlib.nullcontext() if keep is None or name in keep \
                else init.skipped()

        self.vocab, self.seq_len, self.tie_weights = vocab, seq_len, tie_weights
        self.pad_id = pad_id
        with kept("tok"):
            self.tok = Embedding(vocab, dim, std=0.02, rng=rng, dtype=dtype)
        with kept("pos"):
            self.pos = Parameter(init.normal((seq_len, dim), 0.02, rng, dtype))
        blocks = []
        for i in range(layers):
            with kept(f"blocks.{i}"):
                blocks.append(TransformerEncoderLayer(
                    dim, heads, ffn or 4 * dim, dropout, causal=True, approximate="tanh",
                    recompute=recompute, rng=rng, dtype=dtype))
        self.blocks = ModuleList(blocks)
        with kept("norm"):
            self.norm = LayerNorm(dim, dtype=dtype)
        if not tie_weights:
            with kept("head"):
                self.head = Linear(dim, vocab, bias=False, rng=rng, dtype=dtype)

    def set_recompute(self, mode: str) -> "GPT":
        """Recompute ``"none"``, ``"selective"`` or ``"full"`` from the next forward on."""
        set_recompute(self, mode)
        return self

    def forward(self, ids: Any) -> Tensor:
        ids = as_input(ids)
        t = ids.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.seq_len}")
        pos = self.pos if t == self.seq_len else F.getitem(self.pos, slice(0, t))
        x = F.add(self.tok(ids), pos)  # (B, T, D)
        for block in self.blocks:
            x = block(x)
        weight = self.tok.weight if self.tie_weights else self.head.weight
        return linear(self.norm(x), weight)  # (B, T, vocab)

    def loss(self, ids: Any, reduction: str = "sum") -> Tensor:
        """Next-token cross-entropy of ``ids`` ``(B, T)``: position t predicts token t+1.

        Targets equal to ``pad_id`` count nothing (``reduction="mean"`` averages over
        the real targets only); with ``"sum"`` (data parallelism's convention, divided
        by the global count of real targets) use :meth:`count_targets` for that count.
        """
        ids = as_input(ids)
        logits = self(ids[:, :-1])  # (B, T-1, vocab)
        return F.softmax_cross_entropy(logits, ids[:, 1:], ignore_index=self.pad_id,
                                       reduction=reduction)

    def count_targets(self, ids: Any) -> int:
        """How many next-token targets of ``ids`` count (those that are not padding)."""
        targets = as_input(ids)[:, 1:]
        if self.pad_id is None:
            return int(targets.size)
        return int((targets != self.pad_id).sum())
