"""Batch normalisation over the batch and spatial axes, per channel, forward and backward.

``x (B, C, *S)`` (or ``(B, C)``) is normalised per channel over ``B * prod(S)`` values.
Training mode uses the batch's statistics and updates the running ones in place;
evaluation mode uses the running statistics (an affine map per channel).

Statistics across ranks. One code path serves one process and many: the per-channel
sums are reduced by an optional ``allreduce`` callable (identity when None), so
:class:`mpidl.parallel.SyncBatchNorm` is this function with its communicator's
``allreduce_``. Forward reduces one float64 buffer ``[count, sum x, sum x^2]`` (``2C +
1`` numbers), backward one ``[sum gy, sum gy (x - mean)]`` (``2C``): one allreduce each,
exact for uneven per-rank batches and for a rank with no samples (it adds zeros).

Why float64 and a shift. ``var = E[x^2] - E[x]^2`` cancels when ``|mean| >> std``: in
float32 (7 digits) a mean of 1000 and a std of 1 leave no correct digit. So each rank
sums ``x - m`` and ``(x - m)^2`` about its own local mean ``m`` (small, well-conditioned
numbers, summed per row in the input's dtype by BLAS), then forms the raw sums
``n m + sum(x - m)`` and ``sum(x - m)^2 + 2 m sum(x - m) + n m^2`` in float64, where the
final subtraction loses only ``(mean/std)^2`` float64 ulps (1e-8 relative at 1e4). The
cross-rank sum is float64 too, so the result does not depend on how the batch is split
beyond float64 rounding.

Backward recomputes ``x - mean`` instead of keeping ``xhat`` from forward (as
:mod:`mpidl.functions.norm` does, for the same memory reason). Weight and bias
gradients are this rank's sums (data parallelism adds them up with the other gradients);
the input gradient uses the global sums, as PyTorch's SyncBatchNorm.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import compute_dtype, get_array_module, is_cupy

F64 = numpy.float64


def _compute_dtype(dtype: Any) -> Any:
    # 16-bit sums of squares overflow (float16) or stop growing (bfloat16): normalise in
    # float32 and round once (PyTorch too).
    return compute_dtype(dtype)


def _as3(x: Any, dtype: Any) -> Any:
    """``x (B, C, *S)`` as ``(B, C, P)`` in the compute dtype (a view when possible)."""
    b, c = x.shape[:2]
    x3 = x.reshape(b, c, math.prod(x.shape[2:]))  # not -1: B may be 0 on some rank
    return x3 if x3.dtype == dtype else x3.astype(dtype)


def channel_sum(x3: Any) -> Any:
    """Sum of ``x3 (B, C, P)`` over B and P, as float64 ``(C,)``.

    Each ``(b, c)`` row is summed in the input's dtype as a BLAS matrix-vector product
    (several times faster than ``sum(axis=(0, 2))`` measured, and ``dtype=float64`` is
    slower still); the rows are added in float64.
    """
    xp = get_array_module(x3)
    b, c, p = x3.shape
    if p == 1:
        return x3.reshape(b, c).sum(axis=0, dtype=F64)
    rows = xp.matmul(x3, xp.ones(p, dtype=x3.dtype))  # (B, C)
    return rows.sum(axis=0, dtype=F64)


def channel_dot(a3: Any, b3: Any) -> Any:
    """``sum(a3 * b3)`` over B and P per channel, as float64 ``(C,)`` (rows as above)."""
    xp = get_array_module(a3)
    rows = xp.einsum("bcp,bcp->bc", a3, b3)  # (B, C), no product array
    return rows.sum(axis=0, dtype=F64)


def _per_channel(v: Any, dtype: Any) -> Any:
    """A float64 ``(C,)`` as a ``(C, 1)`` column of the compute dtype (broadcasts on (B, C, P))."""
    return v.astype(dtype)[:, None]


class BatchNormTrain(Function):
    """Batch statistics (optionally over ranks); running statistics updated in place."""

    owned_grads = (0, 1, 2)

    def forward(self, x, weight, bias):
        xp = get_array_module(x)
        ct = _compute_dtype(x.dtype)
        b, c = x.shape[:2]
        x3 = _as3(x, ct)  # (B, C, P)
        n_local = b * x3.shape[2]
        # Shift by this rank's mean (any shift is exact; a close one keeps sums small).
        m = (channel_sum(x3) / max(n_local, 1)).astype(ct)  # (C,)
        xc = x3 - m[:, None]  # (B, C, P); becomes the output in place
        s1c = channel_sum(xc)
        s2c = channel_dot(xc, xc)
        m64 = m.astype(F64)
        stats = xp.empty(2 * c + 1, dtype=F64)  # [count, sum x (C), sum x^2 (C)]
        stats[0] = n_local
        stats[1:c + 1] = n_local * m64 + s1c
        stats[c + 1:] = s2c + 2 * m64 * s1c + n_local * m64 * m64
        if self.allreduce is not None:
            stats = self.allreduce(stats)
        # The (global) count stays an array: on a GPU, reading it would stop the stream
        # once per layer, so there a global batch of one sample is not diagnosed.
        n = stats[0]
        if not is_cupy(xp) or self.allreduce is None:
            total = int(round(float(n))) if self.allreduce is not None else n_local
            if total <= 1:
                raise ValueError(
                    f"batch_norm: training needs more than 1 value per channel, got {total} "
                    f"(input shape {tuple(x.shape)}"
                    f"{', summed over the ranks' if self.allreduce else ''}); use a larger "
                    "batch, or evaluation mode")
        mean = stats[1:c + 1] / n
        var = xp.maximum(stats[c + 1:] / n - mean * mean, 0.0)  # biased, as PyTorch's
        rstd = 1.0 / xp.sqrt(var + self.eps)  # (C,) float64
        scale = rstd if weight is None else rstd * weight.astype(F64)
        shift = (m64 - mean) * scale
        if bias is not None:
            shift += bias.astype(F64)
        xc *= _per_channel(scale, ct)
        xc += _per_channel(shift, ct)
        if self.running_mean is not None:
            self._update_running(xp, mean, var, n)
        self.x3, self.mean, self.rstd, self.n = x3, mean, rstd, n
        self.weight, self.x_shape, self.x_dtype = weight, x.shape, x.dtype
        return xc.reshape(x.shape).astype(x.dtype, copy=False)

    def _update_running(self, xp: Any, mean: Any, var: Any, n: Any) -> None:
        # From the (allreduced) global sums: identical on every rank by construction.
        m = self.momentum
        rm, rv = self.running_mean, self.running_var
        unbiased = var * (n / xp.maximum(n - 1, 1))
        rm[...] = ((1 - m) * rm.astype(F64) + m * mean).astype(rm.dtype)
        rv[...] = ((1 - m) * rv.astype(F64) + m * unbiased).astype(rv.dtype)

    def backward(self, gy):
        xp = get_array_module(gy)
        nx, nw, nb = self.needs_input_grad
        x3, mean, rstd, weight = self.x3, self.mean, self.rstd, self.weight
        ct = x3.dtype
        c = x3.shape[1]
        gy3 = _as3(gy, ct)
        xc = x3 - _per_channel(mean, ct)  # (B, C, P)
        sums = xp.empty(2 * c, dtype=F64)  # [sum gy (C), sum gy (x - mean) (C)]
        sums[:c] = channel_sum(gy3)
        sums[c:] = channel_dot(gy3, xc)
        gw = (sums[c:] * rstd).astype(weight.dtype) if nw else None  # this rank's
        gb = sums[:c].astype(weight.dtype if weight is not None else ct) if nb else None
        if not nx:
            return None, gw, gb
        if self.allreduce is not None:
            sums = self.allreduce(sums)  # global sums for the input gradient
        n = self.n
        scale = rstd if weight is None else rstd * weight.astype(F64)
        # dx = scale (gy - mean(gy) - xhat mean(gy xhat)) = scale gy + k1 (x - mean) + k0
        k1 = -scale * rstd * rstd * sums[c:] / n
        k0 = -scale * sums[:c] / n
        gx = gy3 * _per_channel(scale, ct)
        xc *= _per_channel(k1, ct)
        gx += xc
        gx += _per_channel(k0, ct)
        return gx.reshape(self.x_shape).astype(self.x_dtype, copy=False), gw, gb


class BatchNormEval(Function):
    """Running statistics: ``y = (x - running_mean) / sqrt(running_var + eps) w + b``."""

    owned_grads = (0, 1, 2)

    def forward(self, x, weight, bias):
        ct = _compute_dtype(x.dtype)
        x3 = _as3(x, ct)
        rm = self.running_mean.astype(F64)
        inv = 1.0 / get_array_module(x).sqrt(self.running_var.astype(F64) + self.eps)
        scale = inv if weight is None else inv * weight.astype(F64)
        shift = -rm * scale
        if bias is not None:
            shift += bias.astype(F64)
        y = x3 * _per_channel(scale, ct)
        y += _per_channel(shift, ct)
        self.x3, self.rm, self.inv, self.scale = x3, rm, inv, scale
        self.weight, self.x_shape, self.x_dtype = weight, x.shape, x.dtype
        return y.reshape(x.shape).astype(x.dtype, copy=False)

    def backward(self, gy):
        nx, nw, nb = self.needs_input_grad
        ct = self.x3.dtype
        gy3 = _as3(gy, ct)
        pdtype = self.weight.dtype if self.weight is not None else ct
        gx = gw = gb = None
        if nx:
            gx = (gy3 * _per_channel(self.scale, ct)).reshape(self.x_shape)
            gx = gx.astype(self.x_dtype, copy=False)
        if nw:
            xc = self.x3 - _per_channel(self.rm, ct)
            gw = (channel_dot(gy3, xc) * self.inv).astype(pdtype)
        if nb:
            gb = channel_sum(gy3).astype(pdtype)
        return gx, gw, gb


def batch_norm(x: Any, running_mean: Any = None, running_var: Any = None, weight: Any = None,
               bias: Any = None, training: bool = False, momentum: float = 0.1,
               eps: float = 1e-5, *, allreduce: Callable[[Any], Any] | None = None) -> Tensor:
    """Normalise each channel of ``x (B, C, *S)`` over the batch and spatial axes.

    PyTorch's ``batch_norm`` signature and semantics: ``training`` uses the batch's
    mean and biased variance, and updates ``running_mean``/``running_var`` in place
    (when given) as ``(1 - momentum) running + momentum batch`` with the unbiased
    variance; otherwise the running statistics are used.

    Args:
        x: ``(B, C)`` or ``(B, C, *S)``.
        running_mean, running_var: ``(C,)`` xp arrays (buffers, not Tensors) or None.
        weight, bias: ``(C,)`` affine parameters or None.
        training: batch statistics (True) or running ones (False).
        momentum: weight of the batch in the running statistics' update.
        eps: added to the variance.
        allreduce: sums a contiguous float64 xp array over the ranks in place and
            returns it (collective; :class:`~mpidl.parallel.SyncBatchNorm` passes its
            communicator's ``allreduce_``). Training mode then normalises with the
            statistics of the global batch. None: this process's batch only.

    Raises:
        ValueError: wrong shapes, evaluation mode without running statistics, or (in
            training) a (global) batch with 1 value per channel or none.
    """
    if x.ndim < 2:
        raise ValueError(f"batch_norm: input of shape {tuple(x.shape)} needs (B, C, ...)")
    c = x.shape[1]
    for name, p in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (c,):
            raise ValueError(f"batch_norm: {name} has shape {tuple(p.shape)}, expected ({c},) "
                             f"for an input of {c} channels (shape {tuple(x.shape)})")
    if isinstance(running_mean, Tensor) or isinstance(running_var, Tensor):
        raise TypeError("batch_norm: running statistics are plain xp arrays (buffers), "
                        "not Tensors")
    if (running_mean is None) != (running_var is None):
        raise ValueError("batch_norm: pass both running_mean and running_var, or neither")
    if training:
        return BatchNormTrain.apply(x, weight, bias, running_mean=running_mean,
                                    running_var=running_var, momentum=float(momentum),
                                    eps=float(eps), allreduce=allreduce)
    if running_mean is None:
        raise ValueError("batch_norm: evaluation mode (training=False) needs running_mean "
                         "and running_var")
    return BatchNormEval.apply(x, weight, bias, running_mean=running_mean,
                               running_var=running_var, eps=float(eps))
