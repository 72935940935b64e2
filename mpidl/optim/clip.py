"""Gradient clipping by global norm (Pascanu et al. 2013)."""
from __future__ import annotations

from typing import Any, Iterable

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module


def grad_norm(params: Iterable[Tensor]) -> Any:
    """The 2-norm of all gradients together, as a 0-d xp array (no host sync).

    One pass over each gradient: its sum of squares as a dot product (a BLAS call for
    contiguous arrays), then the square root of the total.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    xp = get_array_module(grads[0])
    # float16 squares overflow past a norm of 256: sum them in float32 at least.
    dtype = xp.promote_types(grads[0].dtype, xp.float32)
    total = None
    for g in grads:
        flat = g.reshape(-1).astype(dtype, copy=False)
        sq = xp.dot(flat, flat)
        total = sq if total is None else total + sq
    return xp.sqrt(xp.asarray(total, dtype=dtype))


def clip_grad_norm_(params: Iterable[Tensor], max_norm: float, eps: float = 1e-6) -> Any:
    """Scale all gradients in place so that their global 2-norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``: the gradients are multiplied by
    ``min(1, max_norm / (norm + eps))``. The factor is computed on the arrays' device and
    applied unconditionally, so clipping never reads the norm back to the host (no sync
    in the step); gradients are scaled in place (they may be views into buckets).

    Under data parallelism call it after the gradients are averaged, so every rank
    computes the same norm and scales the same way.

    Args:
        params: the parameters whose ``.grad`` to clip (those without one are skipped).
        max_norm: the largest allowed global norm.
        eps: added to the norm to avoid dividing by zero.

    Returns:
        The global norm before clipping, a 0-d xp array (``float(...)`` to read it), or
        None when no parameter has a gradient.
    """
    params = list(params)
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    norm = grad_norm(params)
    if norm is None:
        return None
    xp = get_array_module(norm)
    coef = xp.minimum(max_norm / (norm + eps), 1.0).astype(norm.dtype)
    for p in params:
        if p.grad is not None:
            p.grad *= coef
    return norm
