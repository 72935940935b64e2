"""Layer normalisation over the last axis, forward and backward fused by hand."""
from __future__ import annotations

from typing import Any

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module
from mpidl.functions.math import sum_last_axis, sum_leading_axes


class LayerNorm(Function):
    owned_grads = (0, 1, 2)  # every gradient is a fresh array

    def forward(self, x, weight, bias):
        xp = get_array_module(x)
        t = x.dtype.type
        d = x.shape[-1]
        mu = sum_last_axis(x)
        mu *= t(1.0 / d)
        xc = x - mu  # (..., D)
        var = xp.einsum("...i,...i->...", xc, xc)[..., None]
        var *= t(1.0 / d)
        var += t(self.eps)
        rstd = xp.sqrt(var, out=var)
        xp.divide(1, rstd, out=rstd)  # (..., 1)
        xhat = xc
        xhat *= rstd
        self.xhat, self.rstd, self.weight = xhat, rstd, weight
        if weight is None and bias is None:
            return xhat.copy()
        y = xhat * weight if weight is not None else xhat.copy()
        if bias is not None:
            y += bias
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        nx, nw, nb = self.needs_input_grad
        xhat, rstd, weight = self.xhat, self.rstd, self.weight
        d = xhat.shape[-1]
        g2 = gy.reshape(-1, d)
        gw = gb = gx = None
        if nw:
            gw = xp.einsum("ni,ni->i", g2, xhat.reshape(-1, d))
        if nb:
            gb = sum_leading_axes(g2, 1)
        if nx:
            t = xhat.dtype.type
            # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = gy * weight
            g = gy * weight if weight is not None else gy.copy()
            # Fold rstd into the two row terms: dx = rstd g - (a + xhat c).
            a = sum_last_axis(g)
            a *= rstd
            a *= t(1.0 / d)
            c = xp.einsum("...i,...i->...", g, xhat)[..., None]
            c *= rstd
            c *= t(1.0 / d)
            g *= rstd
            corr = xhat * c
            corr += a
            g -= corr
            gx = g
        return gx, gw, gb


def layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Tensor:
    """Normalise over the last axis to zero mean and unit variance, then scale and shift.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with the biased variance (as
    PyTorch's ``layer_norm``). ``weight`` and ``bias`` have shape ``(D,)`` and may be None.
    """
    d = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (d,):
            raise ValueError(f"layer_norm: {name} has shape {tuple(p.shape)}, expected ({d},)")
    return LayerNorm.apply(x, weight, bias, eps=eps)
