"""Text classifiers over token ids: a bag of words, and a small transformer encoder."""
from __future__ import annotations

from typing import Any

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.backend import get_array_module
from mpidl.nn import init
from mpidl.nn.container import ModuleList
from mpidl.nn.embedding import Embedding, EmbeddingBag
from mpidl.nn.linear import Linear
from mpidl.nn.module import Module, Parameter, as_input, default_dtype
from mpidl.nn.transformer import TransformerEncoderLayer


class BagOfWords(Module):
    """Mean of the token embeddings -> Linear -> ReLU -> Linear: ids ``(B, L)`` -> ``(B, classes)``.

    With ``pad_id`` set (what the trainer passes for a text dataset), the mean is over
    the real tokens of each row only: 12-token sentences padded to 256 are otherwise 95%
    padding, and the bag learns nothing (0.46-0.54 test accuracy on the real review
    sentences of issue #14). With ``pad_id=None`` every token counts, padding included
    (as ``torch.nn.EmbeddingBag(mode="mean")`` on fixed-length rows): the reference
    model of the benchmarks, compared with PyTorch as such.

    Args:
        vocab: vocabulary size.
        dim: embedding width.
        hidden: width of the hidden layer.
        classes: number of classes.
        pad_id: the padding token id, left out of the mean, or None.
        pooling: "mean" (the reference) or "sum" of the token embeddings.
        embed_std: the embedding table starts as N(0, embed_std²); 1 is PyTorch's
            default and the reference's, ``mpidl train`` passes 0.1 for a text dataset
            (:func:`mpidl.train.model.model_options` says why).
        seed, rng, dtype: see :mod:`mpidl.nn.init`; float32 by default.
    """

    def __init__(self, vocab: int = 20000, dim: int = 128, hidden: int = 256, classes: int = 2,
                 pad_id: int | None = None, pooling: str = "mean", embed_std: float = 1.0,
                 *, seed: int | None = None,
                 rng: numpy.random.Generator | None = None, dtype: Any = None) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"BagOfWords: pooling={pooling!r}; choose one of {POOLINGS}")
        rng = init.make_rng(seed, rng)
        self.pad_id, self.pooling = pad_id, pooling
        self.embed = EmbeddingBag(vocab, dim, padding_idx=pad_id, std=embed_std, rng=rng,
                                  dtype=dtype)
        self.fc1 = Linear(dim, hidden, rng=rng, dtype=dtype)
        self.fc2 = Linear(hidden, classes, rng=rng, dtype=dtype)

    def forward(self, ids: Any) -> Tensor:
        return self.fc2(F.relu(self.fc1(bag_pool(self.embed, ids, self.pad_id, self.pooling))))


POOLINGS = ("mean", "sum")


def bag_pool(embed: EmbeddingBag, ids: Any, pad_id: int | None, pooling: str) -> Tensor:
    """``embed``'s mean over each row's real tokens (``pooling="mean"``), or their sum:
    the mean times the number of real tokens (``"sum"``), ``(B, L)`` -> ``(B, dim)``."""
    pooled = embed(ids)  # (B, D)
    if pooling == "mean":
        return pooled
    ids = as_input(ids)
    xp = get_array_module(ids)
    n = ids.shape[-1] if pad_id is None else (ids != pad_id).sum(axis=-1)
    n = xp.asarray(n, dtype=embed.weight.data.dtype).reshape(-1, 1)  # (B, 1), constant
    return F.mul(pooled, n)


class TransformerClassifier(Module):
    """Token + learned position embeddings, pre-LN encoder layers, mean over time, Linear.

    ids ``(B, T)`` with ``T <= seq_len`` -> logits ``(B, classes)``. There is no final
    LayerNorm (the PyTorch reference model of the benchmarks has none either).

    With ``pad_id`` set, padding positions are left out: keys equal to ``pad_id`` get no
    attention and the mean pools over the other positions only. With ``pad_id=None``
    (the default, and the benchmark model) every position counts.

    Args:
        vocab: vocabulary size.
        seq_len: the longest sequence (number of learned positions).
        dim: model width.
        layers: number of encoder layers.
        heads: attention heads per layer.
        ffn: feed-forward hidden width.
        classes: number of classes.
        dropout: residual-branch dropout in the encoder layers.
        pad_id: the padding token id to mask out, or None.
        seed, rng, dtype: see :mod:`mpidl.nn.init`; float32 by default.
    """

    def __init__(self, vocab: int = 8000, seq_len: int = 128, dim: int = 128, layers: int = 2,
                 heads: int = 4, ffn: int = 512, classes: int = 2, dropout: float = 0.0,
                 pad_id: int | None = None, *, seed: int | None = None,
                 rng: numpy.random.Generator | None = None, dtype: Any = None) -> None:
        super().__init__()
        rng = init.make_rng(seed, rng)
        dtype = default_dtype(dtype)
        self.seq_len, self.pad_id = seq_len, pad_id
        self.tok = Embedding(vocab, dim, rng=rng, dtype=dtype)
        self.pos = Parameter(init.normal((seq_len, dim), 0.02, rng, dtype))
        self.layers = ModuleList(
            TransformerEncoderLayer(dim, heads, ffn, dropout, rng=rng, dtype=dtype)
            for _ in range(layers)
        )
        self.head = Linear(dim, classes, rng=rng, dtype=dtype)

    def forward(self, ids: Any) -> Tensor:
        ids = as_input(ids)
        b, t = ids.shape
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.seq_len}")
        pos = self.pos if t == self.seq_len else F.getitem(self.pos, slice(0, t))
        x = F.add(self.tok(ids), pos)  # (B, T, D) + (T, D)
        mask = keep = None
        if self.pad_id is not None:
            xp = get_array_module(ids)
            keep = ids != self.pad_id  # (B, T)
            mask = keep[:, None, None, :]  # (B, 1, 1, T): every query sees non-pad keys
        for layer in self.layers:
            x = layer(x, mask=mask)
        if keep is None:
            pooled = F.mean(x, axis=1)  # (B, D)
        else:
            w = keep.astype(x.dtype)
            w /= xp.maximum(w.sum(axis=1, keepdims=True), 1)  # (B, T), rows sum to 1
            pooled = F.sum(F.mul(x, w[:, :, None]), axis=1)
        return self.head(pooled)
