"""Layer normalisation over the last axis, forward and backward fused by hand.

Forward keeps only the per-row mean and reciprocal standard deviation (and the input,
which the graph holds anyway), not the normalised ``xhat``: backward recomputes the
centred input in one pass. A saved ``xhat`` would be one more activation-sized array
alive from forward to backward per call; on the CPU every such array is fresh memory
that the kernel hands out page by page in each step's forward (glibc returns freed
memory at the end of a step), which costs more than the pass that recomputes it.
"""
from __future__ import annotations

from typing import Any


from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module
from mpidl.functions.half import widened
from mpidl.functions.math import sum_last_axis, sum_leading_axes

# NumPy runs ``(N, D) op (D,)`` as N inner loops of D elements, each with per-call
# overhead; for D = 128 that is twice the time of one pass over two contiguous arrays.
# Seen as ``(N / k, k D)`` against the vector tiled k times, the loops are k times longer.
_TILE_ELEMENTS = 1 << 14


def _op_with_row_vector(op: Any, a: Any, v: Any, out: Any) -> Any:
    """``op(a, v, out=out)`` for C-contiguous ``a``/``out`` of shape ``(..., D)`` and ``v`` (D,)."""
    xp = get_array_module(a)
    d = v.shape[0]
    n = a.size // d if d else 0
    k = max(1, min(n, _TILE_ELEMENTS // max(d, 1)))
    while k > 1 and n % k:
        k //= 2
    if k == 1 or not (a.flags.c_contiguous and out.flags.c_contiguous):
        return op(a, v, out=out)
    op(a.reshape(n // k, k * d), xp.tile(v, k), out=out.reshape(n // k, k * d))
    return out


@widened  # 16-bit floats: a float16 sum of squares overflows (D = 1024, std 10: inf, so
class LayerNorm(Function):  # an output of zeros): normalise in float32, round once
    owned_grads = (0, 1, 2)  # every gradient is a fresh array

    def forward(self, x, weight, bias):
        return self._forward(x, weight, bias)

    def backward(self, gy):
        return self._backward(gy)

    def _forward(self, x, weight, bias):
        xp = get_array_module(x)
        t = x.dtype.type
        d = x.shape[-1]
        mu = sum_last_axis(x)  # (..., 1)
        mu *= t(1.0 / d)
        y = x - mu  # centred; becomes the output in place
        # Two-pass variance (of the centred values): no cancellation when |mean| >> std.
        var = xp.einsum("...i,...i->...", y, y)[..., None]
        var *= t(1.0 / d)
        var += t(self.eps)
        rstd = xp.sqrt(var, out=var)
        xp.divide(1, rstd, out=rstd)  # (..., 1)
        y *= rstd
        if weight is not None:
            _op_with_row_vector(xp.multiply, y, weight, y)
        if bias is not None:
            _op_with_row_vector(xp.add, y, bias, y)
        self.x, self.mu, self.rstd, self.weight = x, mu, rstd, weight
        return y

    def _backward(self, gy):
        xp = get_array_module(gy)
        nx, nw, nb = self.needs_input_grad
        x, mu, rstd, weight = self.x, self.mu, self.rstd, self.weight
        t = x.dtype.type
        d = x.shape[-1]
        g2 = gy.reshape(-1, d)
        gw = gb = gx = None
        if nb:
            gb = sum_leading_axes(g2, 1)
        if not (nx or nw):
            return gx, gw, gb
        xc = x - mu  # xhat = xc * rstd
        # gy * xc serves both the weight gradient, sum_n gy xhat, and the row dot
        # products sum_i g xc (g = gy * weight) of the input gradient.
        gxc = gy * xc
        if nw:
            # sum over rows n of rstd_n (gy xc)_n: one matrix-vector product.
            gw = xp.matmul(rstd.reshape(-1), gxc.reshape(-1, d))
        if nx:
            # dx = rstd (g - mean(g) - xhat mean(g xhat)) = rstd g + alpha xc + beta
            # with alpha = -rstd^3 mean(g xc), beta = -rstd mean(g) (per row).
            if weight is not None:
                a = xp.matmul(gy, weight)[..., None]  # sum_i g
                e = xp.matmul(gxc, weight)[..., None]  # sum_i g xc
                g = _op_with_row_vector(xp.multiply, gy, weight, xp.empty(gy.shape, gy.dtype))
            else:
                a, e = sum_last_axis(gy), sum_last_axis(gxc)
                g = gy.copy()
            del gxc
            r2 = rstd * rstd
            e *= r2
            e *= rstd
            e *= t(-1.0 / d)  # alpha
            a *= rstd
            a *= t(-1.0 / d)  # beta
            g *= rstd
            xc *= e
            g += xc
            g += a
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
