"""Activations and normalised exponentials: relu, leaky_relu, tanh, sigmoid, gelu, softmax,
log_softmax.

GELU needs ``erf``, which NumPy lacks (and SciPy is not a dependency). :func:`erf`
evaluates it with rational approximations, the same code on NumPy and CuPy: for float64
Cephes' ``erf``/``erfc`` (Moshier, public domain; about 1e-16 relative), for float32 and
float16 the single clamped rational function of Eigen and XLA (a few float32 ulp, one
branch, so about two dozen array operations, run on cache-sized blocks on the CPU).
"""
from __future__ import annotations

import math
from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, is_cupy
from mpidl.functions.half import widened
from mpidl.functions.math import sum_last_axis

# -- erf ------------------------------------------------------------------------------
# Eigen's generic_fast_erf_float: erf(x) ~ x * P(x^2) / Q(x^2) on x clamped to [-4, 4]
# (erf(4) rounds to 1 in float32). Coefficients highest degree first.
_ERF32_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
            -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
            -1.60960333262415e-02)
_ERF32_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
            -7.37332916720468e-03, -1.42647390514189e-02)

# Cephes ndtr.c: erf for |x| <= 1 is x T(x^2)/U(x^2); erfc for 1 < |x| < 8 is
# exp(-x^2) P(x)/Q(x), for |x| >= 8 exp(-x^2) R(x)/S(x). U, Q, S have a leading 1.
_CEPHES_T = (9.60497373987051638749e0, 9.00260197203842689217e1, 2.23200534594684319226e3,
             7.00332514112805075473e3, 5.55923013010394962768e4)
_CEPHES_U = (1.0, 3.35617141647503099647e1, 5.21357949780152679795e2,
             4.59432382970980127987e3, 2.26290000613890934246e4, 4.92673942608635921086e4)
_CEPHES_P = (2.46196981473530512524e-10, 5.64189564831068821977e-1, 7.46321056442269912687e0,
             4.86371970985681366614e1, 1.96520832956077098242e2, 5.26445194995477358631e2,
             9.34528527171957607540e2, 1.02755188689515710272e3, 5.57535335369399327526e2)
_CEPHES_Q = (1.0, 1.32281951154744992508e1, 8.67072140885989742329e1,
             3.54937778887819891062e2, 9.75708501743205489753e2, 1.82390916687909736289e3,
             2.24633760818710981792e3, 1.65666309194161350182e3, 5.57535340817727675546e2)
_CEPHES_R = (5.64189583547755073984e-1, 1.27536670759978104416e0, 5.01905042251180477414e0,
             6.16021097993053585195e0, 7.40974269950448939160e0, 2.97886665372100240670e0)
_CEPHES_S = (1.0, 2.26052863220117276590e0, 9.39603524938001434673e0,
             1.20489539808096656605e1, 1.70814450747565897222e1, 9.60896809063285878198e0,
             3.36907645100081516050e0)


# NumPy evaluates each operation over the whole array, so a dozen-step polynomial on a
# large activation streams it through memory a dozen times (and every temporary is a
# fresh allocation that page-faults). Working on blocks that stay in cache with reused
# buffers makes GELU about twice as fast. CuPy runs each step as one kernel: no blocks.
_BLOCK = 1 << 18


def _blocks(xp: Any, n: int) -> list[slice]:
    if is_cupy(xp) or n <= _BLOCK:
        return [slice(0, n)]
    return [slice(i, min(i + _BLOCK, n)) for i in range(0, n, _BLOCK)]


def _block_len(xp: Any, n: int) -> int:
    """Length of the longest block of :func:`_blocks` (scratch arrays are this long)."""
    return n if is_cupy(xp) else min(n, _BLOCK)


def _polyval(coefs: tuple, z: Any, out: Any) -> Any:
    """Horner's rule on an array, into ``out``."""
    xp = get_array_module(z)
    t = z.dtype.type
    xp.multiply(z, t(coefs[0]), out=out)
    out += t(coefs[1])
    for c in coefs[2:]:
        out *= z
        out += t(c)
    return out


# The normal CDF Phi(x) = 0.5 + 0.5 erf(x / sqrt 2) with the same rational function,
# the 1/sqrt(2) and 0.5 folded into the coefficients (three array passes fewer):
# Phi(x) = 0.5 + x P~(x^2) / Q~(x^2), P~_k = p_k / (2 sqrt 2 * 2^k), Q~_k = q_k / 2^k.
def _scaled(coefs: tuple, factor: float) -> tuple:
    degree = len(coefs) - 1  # coefficients of z^degree ... z^0
    return tuple(c * factor / 2.0 ** (degree - i) for i, c in enumerate(coefs))


_PHI32_P = _scaled(_ERF32_P, 0.5 / math.sqrt(2.0))
_PHI32_Q = _scaled(_ERF32_Q, 1.0)


# x P(z) / Q(z) = x P'(z) / Q'(z) with P' = P / p_0 monic and Q' = Q / p_0: Horner on a
# monic polynomial starts with one addition instead of a multiplication and an addition.
def _monic(p: tuple, q: tuple) -> tuple[tuple, tuple]:
    return tuple(c / p[0] for c in p[1:]), tuple(c / p[0] for c in q)


_ERF32_MONIC = _monic(_ERF32_P, _ERF32_Q)
_PHI32_MONIC = _monic(_PHI32_P, _PHI32_Q)


def _polyval_monic(tail: tuple, z: Any, out: Any) -> Any:
    """Horner's rule for ``z^n + tail[0] z^(n-1) + ... + tail[-1]``, into ``out``."""
    xp = get_array_module(z)
    t = z.dtype.type
    xp.add(z, t(tail[0]), out=out)
    for c in tail[1:]:
        out *= z
        out += t(c)
    return out


def _erf32_block(x: Any, out: Any, c: Any, z: Any, phi: bool = False) -> None:
    """Float32 erf (or, with ``phi``, the normal CDF) of block ``x`` into ``out``.

    ``c`` and ``z`` are scratch arrays of x's size. 23 array passes (25 with ``phi``).
    """
    xp = get_array_module(x)
    t = x.dtype.type
    bound = 4.0 * math.sqrt(2.0) if phi else 4.0
    p, q = _PHI32_MONIC if phi else _ERF32_MONIC
    xp.clip(x, t(-bound), t(bound), out=c)
    xp.multiply(c, c, out=z)
    _polyval_monic(p, z, out)
    out *= c
    _polyval(q, z, c)
    out /= c
    if phi:
        out += t(0.5)
        # Past the clamp, 0.5 + x P/Q rounds to -6e-8, not 0: a wrong-signed GELU that
        # grows with |x| (x * Phi at x = -1e6: 0.06). A CDF is never negative.
        xp.maximum(out, t(0), out=out)


def erf(x: Any) -> Any:
    """The error function of a float array (NumPy or CuPy), in the array's dtype.

    Not differentiable by itself (it works on raw arrays); :func:`gelu` uses it.
    """
    xp = get_array_module(x)
    if x.dtype == numpy.float64:
        return _erf_cephes(xp, x)
    flat = xp.ascontiguousarray(x, dtype=numpy.float32).reshape(-1)
    out = xp.empty_like(flat)
    scratch = xp.empty((2, _block_len(xp, flat.size)), dtype=numpy.float32)
    for b in _blocks(xp, flat.size):
        n = b.stop - b.start
        _erf32_block(flat[b], out[b], scratch[0, :n], scratch[1, :n])
    return out.reshape(x.shape).astype(x.dtype, copy=False)


def _erf_cephes(xp: Any, x: Any) -> Any:
    # float64 is for gradient checks and references: accuracy first, no blocking.
    a = xp.abs(x)
    out = xp.empty_like(x)
    small = a <= 1.0
    xs = x[small]
    z = xs * xs
    out[small] = xs * _polyval(_CEPHES_T, z, xp.empty_like(z)) / _polyval(
        _CEPHES_U, z, xp.empty_like(z))
    big = ~small
    # erfc(x) = exp(-x^2) underflows to 0 beyond |x| ~ 27 (erf is 1 there), so clamping
    # to 30 changes nothing and keeps the polynomials from overflowing.
    ab = xp.minimum(a[big], 30.0)
    lo, hi = xp.minimum(ab, 8.0), xp.maximum(ab, 8.0)  # each branch on its own range
    mid = ab < 8.0
    num = xp.where(mid, _polyval(_CEPHES_P, lo, xp.empty_like(ab)),
                   _polyval(_CEPHES_R, hi, xp.empty_like(ab)))
    den = xp.where(mid, _polyval(_CEPHES_Q, lo, xp.empty_like(ab)),
                   _polyval(_CEPHES_S, hi, xp.empty_like(ab)))
    erfc = xp.exp(-ab * ab) * num / den
    out[big] = xp.copysign(1.0 - erfc, x[big])
    return out


# -- functions -----------------------------------------------------------------------
class ReLU(Function):
    def forward(self, x):
        xp = get_array_module(x)
        self.y = xp.maximum(x, x.dtype.type(0))
        return self.y

    def backward(self, gy):
        return gy * (self.y > 0)


class LeakyReLU(Function):
    # max(x, slope x) (min for a slope above 1) and, backward, gy * (mask (1 - slope) +
    # slope): plain ufunc passes. copyto(where=mask) in both directions measured 5x
    # slower on a (8, 32, 32, 32, 32) float32 activation (45 ms against 8-9 ms each way).
    def forward(self, x):
        xp = get_array_module(x)
        slope = x.dtype.type(self.slope)
        self.mask = x > 0  # bool: a quarter of a saved float32 input
        y = x * slope
        (xp.maximum if self.slope <= 1 else xp.minimum)(y, x, out=y)
        return y

    def backward(self, gy):
        g = self.mask.astype(gy.dtype)  # 1 where x > 0
        g *= gy.dtype.type(1 - self.slope)
        g += gy.dtype.type(self.slope)
        g *= gy
        return g


class Tanh(Function):
    def forward(self, x):
        self.y = get_array_module(x).tanh(x)
        return self.y

    def backward(self, gy):
        y = self.y
        g = y * y
        g -= 1
        g *= gy
        return -g


class Sigmoid(Function):
    def forward(self, x):
        xp = get_array_module(x)
        # e = exp(-|x|) never overflows; 1 / (1 + e) for x >= 0 and e / (1 + e) below
        # keep every digit for negative x, where 0.5 (1 + tanh(x / 2)) cancels to 0
        # (float32 at x = -20: 2.06e-9, not 0; log(sigmoid) stays finite).
        e = xp.exp(-xp.abs(x))
        d = e + 1
        y = xp.where(x >= 0, 1, e)
        y = y.astype(x.dtype, copy=False)
        y /= d
        self.y = y
        return y

    def backward(self, gy):
        y = self.y
        return gy * y * (1 - y)


_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


# 16-bit floats are computed in float32 and rounded once at the end (as PyTorch): in
# float16, 1 + erf cancels near x = -3 (8% off) and x * x overflows past 256.
@widened
class GELU(Function):
    """GELU on cache-sized blocks (see ``_blocks``), exact (erf) or tanh-approximated."""

    def forward(self, x):
        xp = get_array_module(x)
        out_dtype = x.dtype
        xf = xp.ascontiguousarray(x).reshape(-1)
        y = xp.empty_like(xf)
        # Saved for backward: Phi(x) for the exact form, tanh(u) for the approximation.
        saved = xp.empty_like(xf)
        exact = self.approximate == "none"
        if exact and x.dtype != numpy.float32:
            # float64 (gradient checks) wants Cephes' accuracy.
            xp.add(erf(xf * xf.dtype.type(_SQRT_HALF)), 1, out=saved)
            saved *= xf.dtype.type(0.5)
            xp.multiply(xf, saved, out=y)
        else:
            scratch = xp.empty((2, _block_len(xp, xf.size)), dtype=x.dtype)
            for b in _blocks(xp, xf.size):
                n = b.stop - b.start
                _gelu_forward_block(xf[b], y[b], saved[b], scratch[0, :n], scratch[1, :n],
                                    exact)
        self.x, self.saved = xf, saved
        return y.reshape(x.shape).astype(out_dtype, copy=False)

    def backward(self, gy):
        xp = get_array_module(gy)
        g = xp.ascontiguousarray(gy, dtype=self.x.dtype).reshape(-1)
        gx = xp.empty_like(self.x)
        exact = self.approximate == "none"
        scratch = xp.empty(_block_len(xp, gx.size), dtype=gx.dtype)
        for b in _blocks(xp, gx.size):
            _gelu_backward_block(self.x[b], self.saved[b], g[b], gx[b],
                                 scratch[: b.stop - b.start], exact)
        return gx.reshape(gy.shape).astype(gy.dtype, copy=False)


def _gelu_forward_block(x: Any, y: Any, saved: Any, s1: Any, s2: Any, exact: bool) -> None:
    xp = get_array_module(x)
    t = x.dtype.type
    if exact:
        # saved = Phi(x) = 0.5 (1 + erf(x / sqrt 2)); y = x Phi(x)
        _erf32_block(x, saved, s1, s2, phi=True)
        xp.multiply(x, saved, out=y)
        return
    # y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3); saved = tanh(u)
    xp.multiply(x, x, out=s1)
    s1 *= t(_GELU_TANH_C)
    s1 += t(1.0)
    s1 *= x
    s1 *= t(_SQRT_2_OVER_PI)
    xp.tanh(s1, out=saved)
    xp.add(saved, t(1.0), out=y)
    y *= x
    y *= t(0.5)


def _gelu_backward_block(x: Any, saved: Any, gy: Any, gx: Any, s1: Any, exact: bool) -> None:
    xp = get_array_module(x)
    t = x.dtype.type
    if exact:
        # dy/dx = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
        xp.multiply(x, x, out=gx)
        gx *= t(-0.5)
        xp.exp(gx, out=gx)
        gx *= x
        gx *= t(_INV_SQRT_2PI)
        gx += saved
        gx *= gy
        return
    # dy/dx = 0.5 (1 + th) + 0.5 x (1 - th^2) sqrt(2/pi) (1 + 3c x^2), th = tanh(u)
    xp.multiply(x, x, out=gx)
    gx *= t(3 * _GELU_TANH_C * _SQRT_2_OVER_PI)
    gx += t(_SQRT_2_OVER_PI)
    xp.multiply(saved, saved, out=s1)
    xp.subtract(t(1.0), s1, out=s1)
    gx *= s1
    gx *= x
    gx += saved
    gx += t(1.0)
    gx *= t(0.5)
    gx *= gy


class Softmax(Function):
    def forward(self, x):
        self.y = _softmax(x, self.axis)
        return self.y

    def backward(self, gy):
        xp = get_array_module(gy)
        y = self.y
        # J^T g = y * (g - sum(g * y))
        if self.axis in (-1, y.ndim - 1):
            s = xp.einsum("...i,...i->...", gy, y)[..., None]
        else:
            s = (gy * y).sum(axis=self.axis, keepdims=True)
        gx = gy - s
        gx *= y
        return gx


class LogSoftmax(Function):
    def forward(self, x):
        xp = get_array_module(x)
        y = x - x.max(axis=self.axis, keepdims=True)
        lse = xp.log(_sum(xp.exp(y), self.axis))
        y -= lse
        self.y = y
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        # g - softmax * sum(g)
        s = _sum(gy, self.axis)
        gx = xp.exp(self.y)
        gx *= -s
        gx += gy
        return gx


def _softmax(x: Any, axis: int) -> Any:
    xp = get_array_module(x)
    y = x - x.max(axis=axis, keepdims=True)  # largest term is exp(0) = 1: no overflow
    xp.exp(y, out=y)
    y /= _sum(y, axis)
    return y


def _sum(x: Any, axis: int) -> Any:
    if axis in (-1, x.ndim - 1):
        return sum_last_axis(x)
    return x.sum(axis=axis, keepdims=True)


def relu(x: Any) -> Tensor:
    """Rectified linear unit, elementwise ``max(x, 0)``."""
    return ReLU.apply(x)


def leaky_relu(x: Any, negative_slope: float = 0.01) -> Tensor:
    """Leaky rectified linear unit: ``x`` where ``x > 0``, else ``negative_slope * x``."""
    return LeakyReLU.apply(x, slope=float(negative_slope))


def tanh(x: Any) -> Tensor:
    """Elementwise hyperbolic tangent."""
    return Tanh.apply(x)


def sigmoid(x: Any) -> Tensor:
    """Elementwise logistic function ``1 / (1 + exp(-x))``."""
    return Sigmoid.apply(x)


def gelu(x: Any, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit ``x * Phi(x)`` (Hendrycks & Gimpel 2016).

    Args:
        x: input.
        approximate: ``"none"`` for the exact erf form, ``"tanh"`` for
            ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (GPT-2's); the same
            names as PyTorch's ``gelu``.
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate={approximate!r}; use 'none' (erf) or 'tanh'")
    return GELU.apply(x, approximate=approximate)


def softmax(x: Any, axis: int = -1) -> Tensor:
    """``exp(x) / sum(exp(x))`` along ``axis``, computed stably (max subtracted)."""
    return Softmax.apply(x, axis=axis)


def log_softmax(x: Any, axis: int = -1) -> Tensor:
    """``x - logsumexp(x)`` along ``axis``, computed stably."""
    return LogSoftmax.apply(x, axis=axis)
