"""Embedding tables: one vector per token id, and the mean of a bag of ids."""
from __future__ import annotations

from typing import Any

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn import init
from mpidl.nn.module import Module, Parameter, as_input, default_dtype


class Embedding(Module):
    """Look up rows of a ``(num_embeddings, dim)`` table: ids ``(...)`` -> ``(..., dim)``.

    The table starts as N(0, std²) (std 1, PyTorch's default). The backward is a
    scatter-add of the output gradient into the rows that were looked up.

    Args:
        num_embeddings: vocabulary size; ids must lie in ``[0, num_embeddings)``.
        dim: embedding size.
        std: standard deviation of the initial values.
        seed, rng: where the initial values come from (see :mod:`mpidl.nn.init`).
        dtype: parameter dtype (float32 by default).
    """

    def __init__(self, num_embeddings: int, dim: int, *, std: float = 1.0,
                 seed: int | None = None, rng: numpy.random.Generator | None = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if num_embeddings <= 0 or dim <= 0:
            raise ValueError(
                f"{type(self).__name__} needs positive sizes, got "
                f"num_embeddings={num_embeddings}, dim={dim}"
            )
        self.num_embeddings, self.dim = num_embeddings, dim
        rng = init.make_rng(seed, rng)
        self.weight = Parameter(init.normal((num_embeddings, dim), std, rng, default_dtype(dtype)))

    def forward(self, ids: Any) -> Tensor:
        return F.embedding(as_input(ids), self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}"


class EmbeddingBag(Embedding):
    """The mean of the embeddings of a bag of ids: ids ``(..., L)`` -> ``(..., dim)``.

    As ``torch.nn.EmbeddingBag(mode="mean")`` on fixed-length bags: the last axis of
    ``ids`` is the bag. Arguments as :class:`Embedding`, and ``padding_idx``: an id left
    out of every mean (padding of fixed-length rows; a bag of only padding gives zeros).
    """

    def __init__(self, num_embeddings: int, dim: int, *, padding_idx: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(num_embeddings, dim, **kwargs)
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"EmbeddingBag: padding_idx={padding_idx} is not an id of a "
                             f"table of {num_embeddings} rows")
        self.padding_idx = padding_idx

    def forward(self, ids: Any) -> Tensor:
        return F.embedding_bag(as_input(ids), self.weight, padding_idx=self.padding_idx)
