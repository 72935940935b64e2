"""Gradient clipping by global norm (Pascanu et al. 2013)."""
from __future__ import annotations

from typing import Any, Iterable

import numpy

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module


def gradient_norm(pieces: Iterable[tuple[Any, bool]], *, shards: Any = None,
                  tensor: Any = None, xp: Any = None) -> Any:
    """The 2-norm of a gradient held in pieces, a 0-d xp array: the one norm of mpidl.

    Every layout computes its norm here (data parallel, tensor parallel, ZeRO, ZeRO on a
    tensor grid), so they clip alike. Each piece is ``(array, split)``: a ``split``
    piece is part of a tensor-parallel parameter, whose squares add up over ``tensor``;
    the others are replicated over ``tensor`` and count once (a sum over every rank
    would count them ``tensor.size`` times). With ``shards`` (ZeRO's replicas), the
    pieces of the ranks are disjoint blocks of one gradient, and all squares add up
    over it. Collective over ``shards`` and ``tensor`` when given (a rank without pieces
    still joins, with ``xp`` its array module); else local, with no host sync.

    Each piece's squares are summed in its dtype widened to float32 at least (float16
    squares overflow past a norm of 256), one dot product per piece; the pieces' sums
    in float64. Returns None when there is no piece and nobody to ask.
    """
    pieces = [(g, bool(split)) for g, split in pieces]
    if not pieces and shards is None and tensor is None:
        return None
    if pieces:
        xp = get_array_module(pieces[0][0])
        dtype = xp.promote_types(pieces[0][0].dtype, xp.float32)
    else:
        xp = xp or numpy
        dtype = numpy.dtype(numpy.float64)
    sq = xp.zeros(2, dtype=xp.float64)  # [split over tensor, replicated over it]
    for g, split in pieces:
        flat = g.reshape(-1).astype(xp.promote_types(g.dtype, xp.float32), copy=False)
        sq[0 if split else 1] += xp.dot(flat, flat)
    if shards is not None and shards.size > 1:
        shards.allreduce_(sq)
    if tensor is not None and tensor.size > 1:
        part = sq[:1].copy()
        tensor.allreduce_(part)
        sq[0] = part[0]
    return xp.sqrt(sq.sum()).astype(dtype)


def grad_norm(params: Iterable[Tensor]) -> Any:
    """The 2-norm of all gradients together, as a 0-d xp array (no host sync; see
    :func:`gradient_norm`), or None when no parameter has a gradient."""
    return gradient_norm((p.grad, False) for p in params if p.grad is not None)


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
