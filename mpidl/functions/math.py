"""Elementwise arithmetic, matrix products and reductions.

Binary operations broadcast like NumPy; their backward sums each gradient back to the
shape of its input (:func:`sum_to`). Either operand may be a Tensor, an xp array or a
Python scalar (``t + 2.0``, ``2.0 - t``, ``array * t``). Python scalars stay "weak"
(NEP 50), so a float32 tensor times ``2.0`` stays float32; NumPy scalars are turned into
Python scalars for the same reason.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module


# NumPy's reductions along the last axis (one short pairwise sum per row) and along
# leading axes of a C-ordered array are several times slower than the same sums as a
# matrix-vector product with a vector of ones, which BLAS vectorises; the float
# functions use these two helpers for their hot sums.
def sum_last_axis(x: Any, keepdims: bool = True) -> Any:
    """``x.sum(axis=-1, keepdims=keepdims)`` for a float array, via BLAS."""
    xp = get_array_module(x)
    if x.dtype.kind != "f" or x.shape[-1] == 0:
        return x.sum(axis=-1, keepdims=keepdims)
    out = xp.matmul(x, xp.ones(x.shape[-1], dtype=x.dtype))
    return out[..., None] if keepdims else out


def sum_leading_axes(x: Any, n: int) -> Any:
    """``x.sum(axis=tuple(range(n)))`` for a float array, via BLAS."""
    xp = get_array_module(x)
    rows = 1
    for d in x.shape[:n]:
        rows *= d
    if x.dtype.kind != "f" or n == 0 or rows == 0 or x.ndim == n:
        return xp.asarray(x.sum(axis=tuple(range(n))))
    x2 = x.reshape(rows, -1)
    return xp.matmul(xp.ones(rows, dtype=x.dtype), x2).reshape(x.shape[n:])


def sum_to(g: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``g`` over the axes that broadcasting added or stretched, to get ``shape``.

    The adjoint of broadcasting: if ``y = broadcast_to(x, g.shape)`` then
    ``dL/dx = sum_to(dL/dy, x.shape)``.
    """
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    stretched = tuple(lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1)
    if not stretched and lead and g.flags.c_contiguous:
        return sum_leading_axes(g, lead)  # a bias-like operand: the common case
    out = g.sum(axis=tuple(range(lead)) + stretched, keepdims=True)
    if lead:
        out = out.reshape(shape)
    return out


def _operand(x: Any) -> Any:
    # NumPy scalars are "strong" under NEP 50 (float32 * np.float64(2) -> float64);
    # Python scalars are weak and keep the tensor's dtype.
    if isinstance(x, numpy.generic):
        return x.item()
    return x


def _shape(x: Any) -> tuple[int, ...]:
    return getattr(x, "shape", ())


class Add(Function):
    def forward(self, a, b):
        self.a_shape, self.b_shape = _shape(a), _shape(b)
        return get_array_module(a, b).add(a, b)

    def backward(self, gy):
        na, nb = self.needs_input_grad
        return (sum_to(gy, self.a_shape) if na else None,
                sum_to(gy, self.b_shape) if nb else None)


class Sub(Function):
    def forward(self, a, b):
        self.a_shape, self.b_shape = _shape(a), _shape(b)
        return get_array_module(a, b).subtract(a, b)

    def backward(self, gy):
        na, nb = self.needs_input_grad
        return (sum_to(gy, self.a_shape) if na else None,
                -sum_to(gy, self.b_shape) if nb else None)


class Mul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return get_array_module(a, b).multiply(a, b)

    def backward(self, gy):
        na, nb = self.needs_input_grad
        return (sum_to(gy * self.b, _shape(self.a)) if na else None,
                sum_to(gy * self.a, _shape(self.b)) if nb else None)


class Div(Function):
    def forward(self, a, b):
        self.a_shape, self.b = _shape(a), b
        self.y = get_array_module(a, b).divide(a, b)
        return self.y

    def backward(self, gy):
        na, nb = self.needs_input_grad
        ga = gy / self.b
        # d(a/b)/db = -a/b^2 = -y/b
        gb = sum_to(-(ga * self.y), _shape(self.b)) if nb else None
        return (sum_to(ga, self.a_shape) if na else None, gb)


class Neg(Function):
    def forward(self, x):
        return -x

    def backward(self, gy):
        return -gy


class Pow(Function):
    def forward(self, x, p):
        xp = get_array_module(x, p)
        self.x, self.p = x, p
        self.y = xp.power(x, p)
        return self.y

    def backward(self, gy):
        nx, np_ = self.needs_input_grad
        x, p = self.x, self.p
        gx = gp = None
        if nx:
            # p * x**(p-1); for a scalar p this avoids x**(p-1) at x == 0 when p == 1.
            if isinstance(p, (int, float)) and p == 2:
                gx = gy * (x * 2)
            elif isinstance(p, (int, float)) and p == 1:
                gx = gy
            else:
                xp = get_array_module(x, p)
                with numpy.errstate(divide="ignore", invalid="ignore"):
                    d = p * x ** (p - 1)
                # x**0 is constant: 0, not the 0 * inf = NaN of the formula at x == 0.
                gx = gy * xp.where(xp.asarray(p) == 0, 0, d).astype(d.dtype, copy=False)
            gx = sum_to(gx, _shape(x))
        if np_:
            xp = get_array_module(x)
            # d(x**p)/dp = x**p log x; at x == 0 (x**p == 0 for p > 0) it is 0, not the
            # 0 * -inf = NaN of the formula.
            log_x = xp.log(xp.where(x == 0, 1, x).astype(self.y.dtype, copy=False))
            gp = sum_to(gy * self.y * log_x, _shape(p))
        return gx, gp


class MatMul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return get_array_module(a, b).matmul(a, b)

    def backward(self, gy):
        xp = get_array_module(gy)
        a, b = self.a, self.b
        na, nb = self.needs_input_grad
        if a.ndim == 1 and b.ndim == 1:  # inner product: gy is a 0-d array
            return (gy * b if na else None), (gy * a if nb else None)
        # Promote 1-D operands as matmul does, so the general formulas apply.
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        g2 = gy
        if a.ndim == 1:
            g2 = xp.expand_dims(g2, -2)
        if b.ndim == 1:
            g2 = xp.expand_dims(g2, -1)
        ga = gb = None
        if na:
            if b2.ndim == 2 and a2.ndim > 2:
                ga = xp.matmul(g2, b2.T)  # (..., M, N) @ (N, K)
            else:
                ga = sum_to(xp.matmul(g2, xp.swapaxes(b2, -1, -2)), a2.shape)
            ga = ga.reshape(a.shape)
        if nb:
            if b2.ndim == 2 and a2.ndim > 2:
                # Fold the batch into the rows: one (K, B*M) @ (B*M, N) product instead of
                # a (B, K, N) temporary summed afterwards.
                k = a2.shape[-1]
                gb = xp.matmul(a2.reshape(-1, k).T, g2.reshape(-1, g2.shape[-1]))
            else:
                gb = sum_to(xp.matmul(xp.swapaxes(a2, -1, -2), g2), b2.shape)
            gb = gb.reshape(b.shape)
        return ga, gb


def _normalize_axis(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, int):
        axis = (axis,)
    return tuple(sorted(a % ndim if ndim else a for a in axis))


class Sum(Function):
    def forward(self, x):
        xp = get_array_module(x)
        self.x_shape = x.shape
        # A full reduction of a NumPy array gives a NumPy scalar; keep arrays throughout.
        return xp.asarray(x.sum(axis=self.axis, keepdims=self.keepdims))

    def backward(self, gy):
        xp = get_array_module(gy)
        if not self.keepdims and self.x_shape:
            gy = gy.reshape(_keepdims_shape(self.x_shape, self.axis))
        return xp.broadcast_to(gy, self.x_shape)


class Mean(Function):
    def forward(self, x):
        xp = get_array_module(x)
        self.x_shape = x.shape
        return xp.asarray(x.mean(axis=self.axis, keepdims=self.keepdims))

    def backward(self, gy):
        xp = get_array_module(gy)
        n = 1
        for a in _normalize_axis(self.axis, len(self.x_shape)):
            n *= self.x_shape[a]
        if not self.keepdims and self.x_shape:
            gy = gy.reshape(_keepdims_shape(self.x_shape, self.axis))
        return xp.broadcast_to(gy * gy.dtype.type(1.0 / max(n, 1)), self.x_shape)


def _keepdims_shape(shape: tuple[int, ...], axis: Any) -> tuple[int, ...]:
    axes = _normalize_axis(axis, len(shape))
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


class Exp(Function):
    def forward(self, x):
        self.y = get_array_module(x).exp(x)
        return self.y

    def backward(self, gy):
        return gy * self.y


class Log(Function):
    def forward(self, x):
        self.x = x
        return get_array_module(x).log(x)

    def backward(self, gy):
        return gy / self.x


def add(a: Any, b: Any) -> Tensor:
    """Elementwise ``a + b`` with broadcasting."""
    return Add.apply(_operand(a), _operand(b))


def sub(a: Any, b: Any) -> Tensor:
    """Elementwise ``a - b`` with broadcasting."""
    return Sub.apply(_operand(a), _operand(b))


def mul(a: Any, b: Any) -> Tensor:
    """Elementwise ``a * b`` with broadcasting."""
    return Mul.apply(_operand(a), _operand(b))


def div(a: Any, b: Any) -> Tensor:
    """Elementwise ``a / b`` with broadcasting."""
    return Div.apply(_operand(a), _operand(b))


def neg(x: Any) -> Tensor:
    """Elementwise ``-x``."""
    return Neg.apply(x)


def pow(x: Any, exponent: Any) -> Tensor:  # noqa: A001 (mirrors the operator's name)
    """Elementwise ``x ** exponent``; the exponent may be a scalar or a tensor."""
    return Pow.apply(x, _operand(exponent))


def matmul(a: Any, b: Any) -> Tensor:
    """Matrix product with NumPy's rules: batched over leading dims, which broadcast.

    ``(..., M, K) @ (..., K, N) -> (..., M, N)``; 1-D operands are promoted as in
    ``numpy.matmul``.
    """
    return MatMul.apply(a, b)


def sum(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis`` (an int, a tuple of ints, or None for all)."""
    return Sum.apply(x, axis=_axis_arg(axis), keepdims=keepdims)


def mean(x: Any, axis: Any = None, keepdims: bool = False) -> Tensor:
    """Mean over ``axis`` (an int, a tuple of ints, or None for all)."""
    return Mean.apply(x, axis=_axis_arg(axis), keepdims=keepdims)


def _axis_arg(axis: Any) -> Any:
    return tuple(axis) if isinstance(axis, list) else axis


def exp(x: Any) -> Tensor:
    """Elementwise ``e ** x``."""
    return Exp.apply(x)


def log(x: Any) -> Tensor:
    """Elementwise natural logarithm."""
    return Log.apply(x)
