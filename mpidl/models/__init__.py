"""Reference models: the ones every benchmark and example of mpidl uses.

=============  ============================================================  ===========
name           model                                                         parameters
=============  ============================================================  ===========
``mlp``        784 -> 1024 -> ReLU -> 1024 -> ReLU -> 10                     1,863,690
``bow``        EmbeddingBag(20000, 128, mean) -> 256 -> ReLU -> 2            2,593,538
``transformer`` vocab 8000, learned positions, seq 128, d 128, 2 pre-LN      1,437,186
               layers (4 heads, FFN 512, GELU), mean-pool -> 2
``gpt``        small causal language model, tied embeddings                  (by config)
=============  ============================================================  ===========

Each builder takes ``seed=`` (or ``rng=``) and ``dtype=``; the same seed gives
bit-identical parameters in every process. A model maps an input array (float features,
or int token ids; a raw xp array or a Tensor) to logits (a Tensor).
"""
from __future__ import annotations

from typing import Any

from mpidl.models.gpt import GPT
from mpidl.models.mlp import MLP
from mpidl.models.textclf import BagOfWords, TransformerClassifier


def mlp(sizes: tuple[int, ...] = (784, 1024, 1024, 10), **kwargs: Any) -> MLP:
    """The reference MLP (784 -> 1024 -> ReLU -> 1024 -> ReLU -> 10) or other ``sizes``."""
    return MLP(sizes, **kwargs)


def bow(vocab: int = 20000, dim: int = 128, hidden: int = 256, classes: int = 2,
        **kwargs: Any) -> BagOfWords:
    """The reference bag-of-words classifier (see :class:`BagOfWords`)."""
    return BagOfWords(vocab, dim, hidden, classes, **kwargs)


def transformer(vocab: int = 8000, seq_len: int = 128, dim: int = 128, layers: int = 2,
                heads: int = 4, ffn: int = 512, classes: int = 2,
                **kwargs: Any) -> TransformerClassifier:
    """The reference transformer classifier (see :class:`TransformerClassifier`)."""
    return TransformerClassifier(vocab, seq_len, dim, layers, heads, ffn, classes, **kwargs)


def gpt(vocab: int = 8000, seq_len: int = 128, dim: int = 128, layers: int = 2,
        heads: int = 4, **kwargs: Any) -> GPT:
    """A small causal language model returning ``(B, T, vocab)`` logits (see :class:`GPT`)."""
    return GPT(vocab, seq_len, dim, layers, heads, **kwargs)


MODELS = {"mlp": mlp, "bow": bow, "transformer": transformer, "gpt": gpt}


def build(name: str, **kwargs: Any) -> Any:
    """Build a reference model by name (``"mlp"``, ``"bow"``, ``"transformer"``, ``"gpt"``)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](**kwargs)


__all__ = ["mlp", "bow", "transformer", "gpt", "build", "MODELS",
           "MLP", "BagOfWords", "TransformerClassifier", "GPT"]
