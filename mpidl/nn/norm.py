"""Layer normalisation (Ba et al. 2016) over the last axis."""
from __future__ import annotations

from typing import Any

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn import init
from mpidl.nn.module import Module, Parameter, default_dtype


class LayerNorm(Module):
    """Normalise the last axis to zero mean and unit variance, then scale and shift.

    Args:
        dim: size of the last axis.
        eps: added to the variance.
        elementwise_affine: learn ``weight`` (ones) and ``bias`` (zeros) of shape ``(dim,)``.
        dtype: parameter dtype (float32 by default).
    """

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True, *,
                 dtype: Any = None) -> None:
        super().__init__()
        if dim <= 0:
            raise ValueError(f"LayerNorm needs dim > 0, got {dim}")
        dtype = default_dtype(dtype)
        self.dim, self.eps = dim, float(eps)
        if elementwise_affine:
            self.weight = Parameter(init.ones((dim,), dtype))
            self.bias = Parameter(init.zeros((dim,), dtype))
        else:
            self.weight = self.bias = None

    def forward(self, x: Any) -> Tensor:
        return F.layer_norm(x, self.weight, self.bias, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
