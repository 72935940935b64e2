"""Shape layers (:mod:`mpidl.functions.array` as modules): Flatten."""
from __future__ import annotations

import math
from typing import Any

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn.module import Module


class Flatten(Module):
    """Merge axes ``start_dim..end_dim`` into one: ``(B, C, H, W) -> (B, C*H*W)`` by default.

    Args:
        start_dim, end_dim: the first and last axis merged (negative counts from the
            end), as PyTorch's ``Flatten``.
    """

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = int(start_dim), int(end_dim)

    def forward(self, x: Any) -> Tensor:
        shape = tuple(x.shape)
        start = self.start_dim % len(shape) if shape else 0
        end = self.end_dim % len(shape) if shape else 0
        if start > end:
            raise ValueError(f"Flatten(start_dim={self.start_dim}, end_dim={self.end_dim}) "
                             f"does not fit an input of shape {shape}")
        # The merged size is a product, not -1: the batch may be empty on some rank.
        new = shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:]
        return F.reshape(x, new)

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"
