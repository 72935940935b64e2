"""A multilayer perceptron: Linear layers with ReLU between them."""
from __future__ import annotations

from typing import Any, Sequence

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn import init
from mpidl.nn.container import ModuleList
from mpidl.nn.linear import Linear
from mpidl.nn.module import Module
from mpidl.nn.standardize import Standardize


class MLP(Module):
    """``sizes[0] -> sizes[1] -> ReLU -> ... -> sizes[-1]`` (no activation on the output).

    Parameters ``layers.<i>.weight`` / ``layers.<i>.bias``. Inputs ``(B, sizes[0])``
    (anything of ``sizes[0]`` features per sample: images are flattened), outputs
    ``(B, sizes[-1])`` logits.

    With ``input_stats`` the inputs are standardised first (buffers ``inputs.mean`` /
    ``inputs.std``); with ``target_stats`` the last layer predicts standard units and the
    outputs are returned in the targets' (``targets.mean`` / ``targets.std``): see
    :class:`~mpidl.nn.Standardize`. ``mpidl train`` passes the train split's column
    statistics; without them the model is the reference MLP.

    Args:
        sizes: layer widths, input first.
        input_stats, target_stats: ``(mean, std)``, one number per input feature / per
            regression target, or None (no scaling).
        seed, rng: where the initial values come from (see :mod:`mpidl.nn.init`).
        dtype: parameter dtype (float32 by default).
    """

    def __init__(self, sizes: Sequence[int], *, input_stats: tuple | None = None,
                 target_stats: tuple | None = None, seed: int | None = None,
                 rng: numpy.random.Generator | None = None, dtype: Any = None) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least an input and an output size, got {sizes}")
        rng = init.make_rng(seed, rng)
        self.sizes = tuple(int(s) for s in sizes)
        self.inputs = Standardize.of(input_stats, self.sizes[0], f"MLP {self.sizes} inputs",
                                     dtype=dtype)
        self.layers = ModuleList(
            Linear(a, b, rng=rng, dtype=dtype) for a, b in zip(self.sizes, self.sizes[1:])
        )
        self.targets = Standardize.of(target_stats, self.sizes[-1],
                                      f"MLP {self.sizes} targets", inverse=True, dtype=dtype)

    def forward(self, x: Any) -> Tensor:
        if self.inputs is not None:
            x = self.inputs(x)
        if x.ndim != 2:
            features = int(numpy.prod(x.shape[1:]))  # not -1: B may be 0 on some rank
            x = F.reshape(x, (x.shape[0], features))  # (B, ...) -> (B, features)
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < n - 1:
                x = F.relu(x)
        return x if self.targets is None else self.targets(x)

    def extra_repr(self) -> str:
        return " -> ".join(map(str, self.sizes))
