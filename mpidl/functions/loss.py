"""Loss functions: fused softmax cross-entropy, mean squared error.

:func:`softmax_cross_entropy` takes logits and integer class labels and never builds
one-hot targets or a separate log-softmax: forward keeps the probabilities, backward is
``(softmax - onehot) * coefficient`` in one pass over them.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy

from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module, to_device
from mpidl.functions.half import widened
from mpidl.functions.math import sum_last_axis

_REDUCTIONS = ("mean", "sum", "none")


# 16-bit logits: the softmax and the loss in float32; the loss stays float32 (Megatron
# computes the cross-entropy in float32 too), the logits' gradient comes back rounded.
@functools.partial(widened, keep_float32=(0,))
class SoftmaxCrossEntropy(Function):
    def forward(self, logits, labels):
        xp = get_array_module(logits)
        n_classes = logits.shape[-1]
        x = logits.reshape(-1, n_classes)  # (N, C)
        t = labels.reshape(-1)  # (N,)
        self.labels_shape = labels.shape
        if self.ignore_index is not None:
            valid = t != self.ignore_index
            t = xp.where(valid, t, 0)
        else:
            valid = None
        rows = xp.arange(t.shape[0])
        shifted = x - x.max(axis=1, keepdims=True)  # (N, C), max is 0: exp cannot overflow
        picked = shifted[rows, t]  # (N,)
        e = xp.exp(shifted, out=shifted)
        s = sum_last_axis(e, keepdims=False)
        nll = xp.log(s)
        nll -= picked  # -log softmax[label] = logsumexp - logit[label]
        e /= s[:, None]
        self.probs, self.t, self.valid, self.rows = e, t, valid, rows
        if valid is not None:
            nll *= valid
        if self.reduction == "none":
            return nll.reshape(labels.shape)
        total = nll.sum()
        if self.reduction == "sum":
            return xp.asarray(total)
        # Mean over the labels that count; a batch with none of them has loss 0 (and a
        # zero gradient) rather than NaN.
        count = valid.sum() if valid is not None else t.shape[0]
        self.count = xp.maximum(count, 1).astype(x.dtype) if valid is not None else max(count, 1)
        return xp.asarray(total / self.count).astype(x.dtype, copy=False)

    def backward(self, gy):
        probs, t, valid, rows = self.probs, self.t, self.valid, self.rows
        if self.reduction == "none":
            coef = gy.reshape(-1)
        elif self.reduction == "sum":
            coef = gy.reshape(1)
        else:
            coef = (gy / self.count).reshape(1)
        coef = coef.astype(probs.dtype, copy=False)
        if valid is not None:
            coef = coef * valid
        if coef.shape[0] == 1 and valid is None:
            g = probs * coef[0]
            g[rows, t] -= coef[0]
        else:
            coef = get_array_module(probs).broadcast_to(coef, t.shape)
            g = probs * coef[:, None]
            g[rows, t] -= coef
        return g.reshape(self.logits_shape), None


def _check_labels(labels: Any, n_classes: int, ignore_index: int | None) -> None:
    """Raise ValueError for a host label outside ``[0, n_classes)`` (not ignore_index).

    Host labels (a loader's batch) are checked here, before they move to the logits'
    device: on the GPU an out-of-range label is not an error but a wrong answer (CuPy's
    take wraps indices), and a check there would cost a host synchronisation. Labels
    already on a device are not checked, as embedding ids are not.
    """
    if get_array_module(labels) is not numpy or not labels.size:
        return
    t = labels if ignore_index is None else labels[labels != ignore_index]
    if t.size and (t.min() < 0 or t.max() >= n_classes):
        bad = t[(t < 0) | (t >= n_classes)].flat[0]
        raise ValueError(
            f"softmax_cross_entropy: label {bad} is out of range for {n_classes} classes "
            f"(labels must lie in [0, {n_classes}) or equal ignore_index={ignore_index})"
        )


def softmax_cross_entropy(
    logits: Any,
    labels: Any,
    ignore_index: int | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy of softmax(logits) against integer labels, fused.

    Args:
        logits: ``(..., C)`` unnormalised scores.
        labels: integer class ids of shape ``logits.shape[:-1]``.
        ignore_index: a label value that contributes no loss and no gradient (padding).
        reduction: ``"mean"`` over the non-ignored labels (0 when there are none),
            ``"sum"``, or ``"none"`` for the per-label losses of shape ``labels.shape``.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; use one of {_REDUCTIONS}")
    if isinstance(labels, Tensor):
        labels = labels.data
    xp = get_array_module(logits)
    if labels.dtype.kind not in "iu":
        raise TypeError(
            f"softmax_cross_entropy: labels must be integer class ids, got dtype {labels.dtype}"
        )
    lshape = tuple(logits.shape)
    tshape = tuple(labels.shape)
    if lshape[:-1] != tshape:
        raise ValueError(
            f"softmax_cross_entropy: labels of shape {tshape} do not match logits of shape "
            f"{lshape}; labels must have shape {lshape[:-1]}"
        )
    _check_labels(labels, lshape[-1], ignore_index)
    labels = to_device(labels, xp)  # host labels for device logits, after the check
    return SoftmaxCrossEntropy.apply(
        logits, labels, ignore_index=ignore_index, reduction=reduction, logits_shape=lshape
    )


class MeanSquaredError(Function):
    def forward(self, a, b):
        xp = get_array_module(a, b)
        self.diff = a - b
        return xp.asarray((self.diff * self.diff).mean()).astype(self.diff.dtype, copy=False)

    def backward(self, gy):
        na, nb = self.needs_input_grad
        g = self.diff * (gy * gy.dtype.type(2.0 / max(self.diff.size, 1)))
        return (g if na else None), (-g if nb else None)


def mean_squared_error(a: Any, b: Any) -> Tensor:
    """``mean((a - b) ** 2)`` over all elements; ``a`` and ``b`` have the same shape."""
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"mean_squared_error: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    return MeanSquaredError.apply(a, b)


class RegressionLoss(Function):
    """Summed squared (``kind="mse"``) or Huber (``"huber"``, ``delta``) error."""

    def forward(self, pred, target):
        xp = get_array_module(pred, target)
        self.diff = pred - target.astype(pred.dtype, copy=False)
        if self.kind == "mse":
            return xp.asarray((self.diff * self.diff).sum(), dtype=pred.dtype)
        a = xp.abs(self.diff)
        d = pred.dtype.type(self.delta)
        quad = xp.minimum(a, d)
        # 0.5 e^2 inside delta, delta (|e| - delta / 2) outside: torch.nn.HuberLoss's form
        return xp.asarray((quad * (a - 0.5 * quad)).sum(), dtype=pred.dtype)

    def backward(self, gy):
        xp = get_array_module(gy)
        np_, nt = self.needs_input_grad
        if self.kind == "mse":
            g = self.diff * (gy * gy.dtype.type(2.0))
        else:
            d = self.diff.dtype.type(self.delta)
            g = xp.clip(self.diff, -d, d) * gy
        return (g if np_ else None), (-g if nt else None)


def regression_loss(pred: Any, target: Any, kind: str = "mse", delta: float = 1.0,
                    reduction: str = "sum") -> Tensor:
    """Squared error (``"mse"``: ``(pred - target)**2``) or Huber error (``"huber"``:
    ``0.5 e**2`` for ``|e| <= delta``, ``delta (|e| - delta / 2)`` beyond, as
    ``torch.nn.HuberLoss``), summed (``"sum"``) or averaged (``"mean"``) over every
    element; ``target`` is cast to ``pred``'s dtype and must have its shape."""
    if kind not in ("mse", "huber"):
        raise ValueError(f"regression_loss: kind={kind!r}; use 'mse' or 'huber'")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"regression_loss: reduction={reduction!r}; use 'sum' or 'mean'")
    if isinstance(target, Tensor):
        target = target.data
    xp = get_array_module(pred)
    if get_array_module(target) is not xp:
        target = to_device(target, xp)
    if tuple(pred.shape) != tuple(target.shape):
        raise ValueError(f"regression_loss: predictions of shape {tuple(pred.shape)} and "
                         f"targets of shape {tuple(target.shape)} differ")
    loss = RegressionLoss.apply(pred, target, kind=kind, delta=float(delta))
    if reduction == "mean":
        from mpidl.functions.math import mul

        return mul(loss, 1.0 / max(int(numpy.prod(pred.shape)), 1))
    return loss
