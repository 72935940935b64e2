"""The linear model: logistic regression on token counts, or on feature vectors.

The honest reference a user would try first (scikit-learn's ``LogisticRegression`` on
word counts, or on standardised columns; ``Ridge`` for regression), trained by the same
data-parallel machinery as every other model: it is a model like the others, so N ranks
x batch b give 1 rank x batch N*b up to float rounding (tests/mpi/test_data_parallel.py).

Token ids ``(B, L)``: ``logits = counts(ids) @ embed.weight + bias``, ``counts`` the
number of times each vocabulary id occurs in the row, padding left out; computed as the
sum of the table rows the ids pick (no ``(B, vocab)`` count matrix is made).
Feature vectors ``(B, ...)``: standardised per column with the train split's statistics
(as the mlp), then one Linear layer; regression targets are predicted in standard units
(``target_stats``), as the mlp does.

Parameters start at zero: the loss is convex, so the start point only matters for how far
a run gets, and a zero start makes the run independent of the seed (only the data order
varies).
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.models.textclf import bag_pool
from mpidl.nn import init
from mpidl.nn.embedding import EmbeddingBag
from mpidl.nn.module import Module, Parameter, default_dtype
from mpidl.nn.standardize import Standardize


class LinearModel(Module):
    """Logistic (or linear) regression over token counts or feature vectors.

    Args:
        vocab: the vocabulary size for token ids (``mpidl train`` passes the dataset's);
            None: the inputs are feature vectors of ``in_shape``.
        in_shape: one sample's shape, for feature vectors (flattened).
        classes: the number of classes (one logit each); or
        outputs: the number of outputs (classes, or regression targets).
        pad_id: the padding id, left out of the counts (None: every id counts).
        input_stats, target_stats: ``(mean, std)`` per input column / per regression
            target (feature vectors only; see :class:`~mpidl.nn.Standardize`).
        seed, rng: accepted like every model's; the parameters start at zero.
        dtype: parameter dtype (float32 by default).
    """

    def __init__(self, vocab: int | None = None, in_shape: tuple | None = None,
                 classes: int | None = None, outputs: int | None = None,
                 pad_id: int | None = None, *, input_stats: tuple | None = None,
                 target_stats: tuple | None = None, seed: int | None = None,
                 rng: numpy.random.Generator | None = None, dtype: Any = None) -> None:
        super().__init__()
        if classes is not None and outputs is not None and classes != outputs:
            raise ValueError(f"LinearModel: classes={classes} and outputs={outputs} disagree")
        width = classes if classes is not None else outputs
        if width is None or width < 1:
            raise ValueError("LinearModel needs the number of classes or outputs (>= 1)")
        if (vocab is None) == (in_shape is None):
            raise ValueError("LinearModel reads token ids (vocab=) or feature vectors "
                             "(in_shape=): give exactly one")
        dtype = default_dtype(dtype)
        self.tokens = vocab is not None
        self.pad_id = pad_id
        self.width = int(width)
        if self.tokens:
            self.inputs_n = int(vocab)
            self.inputs = self.targets = None
        else:
            shape = (in_shape,) if isinstance(in_shape, int) else tuple(in_shape)
            self.inputs_n = int(numpy.prod(shape))
            self.inputs = Standardize.of(input_stats, self.inputs_n, "linear model inputs",
                                         dtype=dtype)
            self.targets = Standardize.of(target_stats, self.width, "linear model targets",
                                          inverse=True, dtype=dtype)
        if self.tokens:
            # (vocab, outputs): a token's row is what each of its occurrences adds to the
            # logits; the bag's sum over the real tokens is counts @ weight
            self.embed = EmbeddingBag(self.inputs_n, self.width, padding_idx=pad_id, std=0.0,
                                      dtype=dtype)
        else:
            self.weight = Parameter(init.zeros((self.inputs_n, self.width), dtype))
        self.bias = Parameter(init.zeros((self.width,), dtype))

    def forward(self, x: Any) -> Tensor:
        if self.tokens:
            # (B, L) -> (B, C), with the bag's sparse backward (the rows a batch touches)
            return F.add(bag_pool(self.embed, x, self.pad_id, "sum"), self.bias)
        if self.inputs is not None:
            x = self.inputs(x)
        if x.ndim != 2:
            x = F.reshape(x, (x.shape[0], self.inputs_n))  # (B, ...) -> (B, features)
        out = F.add(F.matmul(x, self.weight), self.bias)
        return out if self.targets is None else self.targets(out)

    def extra_repr(self) -> str:
        what = "token counts" if self.tokens else "features"
        return f"{self.inputs_n} {what} -> {self.width}"
