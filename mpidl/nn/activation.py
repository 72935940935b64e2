"""Activation functions as modules, for use inside :class:`~mpidl.nn.Sequential`."""
from __future__ import annotations

from typing import Any

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn.module import Module


class ReLU(Module):
    """``max(x, 0)`` elementwise."""

    def forward(self, x: Any) -> Tensor:
        return F.relu(x)


class GELU(Module):
    """Gaussian error linear unit; ``approximate="tanh"`` for GPT-2's tanh form.

    Args:
        approximate: ``"none"`` (exact, erf; PyTorch's default) or ``"tanh"``.
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate={approximate!r}; use 'none' or 'tanh'")
        self.approximate = approximate

    def forward(self, x: Any) -> Tensor:
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class LeakyReLU(Module):
    """``x`` where ``x > 0``, else ``negative_slope * x``, elementwise.

    Args:
        negative_slope: the slope for negative inputs (PyTorch's default 0.01).
    """

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        self.negative_slope = float(negative_slope)

    def forward(self, x: Any) -> Tensor:
        return F.leaky_relu(x, self.negative_slope)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}"


class Tanh(Module):
    """Hyperbolic tangent elementwise."""

    def forward(self, x: Any) -> Tensor:
        return F.tanh(x)
