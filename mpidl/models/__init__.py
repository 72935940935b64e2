"""Reference models: the ones every benchmark and example of mpidl uses.

=============  ============================================================  ===========
name           model                                                         parameters
=============  ============================================================  ===========
``mlp``        784 -> 1024 -> ReLU -> 1024 -> ReLU -> 10                     1,863,690
``bow``        EmbeddingBag(20000, 128, mean) -> 256 -> ReLU -> 2            2,593,538
``transformer`` vocab 8000, learned positions, seq 128, d 128, 2 pre-LN      1,437,186
               layers (4 heads, FFN 512, GELU), mean-pool -> 2
``linear``     logistic regression on token counts or feature vectors       (by data)
               (linear regression for float targets), zero start
``gpt``        small causal language model, tied embeddings                  (by config)
``cnn``        2-D: 3 x {conv 3x3, batch norm, max pool 2, ReLU}             94,186
               (32, 64, 128 channels), global average pool -> linear
``cosmoflow``  3-D, CosmoFlow-like: {conv 2^3 'same', max pool 2,            1,140,388
               LeakyReLU} x 3 (32, 64, 128), flatten -> 128 -> 64 -> 4
=============  ============================================================  ===========

The convolutional models take their shapes from the data: ``in_shape`` is one sample's
shape as a tuple (``(C, H, W)`` for ``cnn``, ``(C, D, H, W)`` for ``cosmoflow``; the
spatial sizes alone mean one channel, e.g. ``(28, 28)``), and ``outputs`` the width of
the output: the number of classes, or of regression targets. The counts above are for
their defaults, ``cnn(in_shape=(1, 28, 28), outputs=10)`` and
``cosmoflow(in_shape=(4, 32, 32, 32), outputs=4)``.

Each builder takes ``seed=`` (or ``rng=``) and ``dtype=``; the same seed gives
bit-identical parameters in every process. A model maps an input array (float features,
or int token ids; a raw xp array or a Tensor) to logits (a Tensor).
"""
from __future__ import annotations

from typing import Any

from mpidl.models.cnn import CNN
from mpidl.models.cosmoflow import CosmoFlow
from mpidl.models.gpt import GPT
from mpidl.models.linear import LinearModel
from mpidl.models.mlp import MLP
from mpidl.models.textclf import BagOfWords, TransformerClassifier


def _standardized(standardize: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the data's statistics when ``standardize`` is False. ``mpidl
    train`` passes the train split's as ``input_stats`` (the mlp's inputs, per column)
    and, for regression, ``target_stats`` (:func:`mpidl.train.model.data_stats`)."""
    if not standardize:
        kwargs.pop("input_stats", None)
        kwargs.pop("target_stats", None)
    return kwargs


def mlp(sizes: tuple[int, ...] = (784, 1024, 1024, 10), standardize: bool = True,
        **kwargs: Any) -> MLP:
    """The reference MLP (784 -> 1024 -> ReLU -> 1024 -> ReLU -> 10) or other ``sizes``;
    ``standardize``: use the data's statistics (inputs and regression targets)."""
    return MLP(sizes, **_standardized(standardize, kwargs))


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


def cnn(in_shape: tuple = (1, 28, 28), outputs: int = 10, standardize: bool = True,
        **kwargs: Any) -> CNN:
    """The reference 2-D CNN for samples of ``in_shape`` (``(C, H, W)`` or ``(H, W)``)
    with ``outputs`` classes or regression targets (see :class:`CNN`); ``standardize``:
    predict regression targets in the data's standard units."""
    return CNN(in_shape, outputs, **_standardized(standardize, kwargs))


def cosmoflow(in_shape: tuple = (4, 32, 32, 32), outputs: int = 4, standardize: bool = True,
              **kwargs: Any) -> CosmoFlow:
    """The CosmoFlow-like 3-D CNN for volumes of ``in_shape`` (``(C, D, H, W)`` or
    ``(D, H, W)``) with ``outputs`` regression targets or classes (see :class:`CosmoFlow`);
    ``standardize``: predict regression targets in the data's standard units (not with
    a bounded ``output_scale``)."""
    if kwargs.get("output_scale") is not None:
        standardize = False  # the bound is in the targets' own units
    return CosmoFlow(in_shape, outputs, **_standardized(standardize, kwargs))


def linear(classes: int | None = None, outputs: int | None = None, standardize: bool = True,
           **kwargs: Any) -> LinearModel:
    """Logistic regression on token counts (``vocab=``) or on feature vectors
    (``in_shape=``), linear regression for float targets (see :class:`LinearModel`);
    ``standardize``: use the data's statistics (feature inputs, regression targets)."""
    return LinearModel(classes=classes, outputs=outputs,
                       **_standardized(standardize, kwargs))


MODELS = {"mlp": mlp, "linear": linear, "bow": bow, "transformer": transformer, "gpt": gpt,
          "cnn": cnn, "cosmoflow": cosmoflow}


def build(name: str, **kwargs: Any) -> Any:
    """Build a reference model by name (one of :data:`MODELS`' keys)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name](**kwargs)


__all__ = ["mlp", "linear", "bow", "transformer", "gpt", "cnn", "cosmoflow", "build", "MODELS",
           "MLP", "LinearModel", "BagOfWords", "TransformerClassifier", "GPT", "CNN", "CosmoFlow"]
