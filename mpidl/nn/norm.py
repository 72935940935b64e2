"""Normalisation layers: layer norm over the last axis, batch norm per channel."""
from __future__ import annotations

from typing import Any

import numpy

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


class BatchNorm(Module):
    """Batch normalisation (Ioffe & Szegedy 2015) per channel of ``(B, C, *S)``.

    Training mode (``model.train()``) normalises with the batch's mean and biased
    variance over B and S, and updates the running statistics; evaluation mode
    (``model.eval()``) uses the running statistics. As PyTorch's ``BatchNorm*d``: the
    running variance is updated with the unbiased batch variance; ``momentum=None``
    makes the running statistics a cumulative average over the batches seen.

    Buffers (in ``state_dict``, not parameters): ``running_mean`` (zeros),
    ``running_var`` (ones), ``num_batches_tracked`` (an int64 scalar array), all
    absent with ``track_running_stats=False`` (which always uses batch statistics).
    :class:`BatchNorm1d`/``2d``/``3d`` check the input's rank; this class takes any.
    Under data parallelism, :func:`mpidl.parallel.convert_sync_batchnorm` replaces
    these layers with :class:`~mpidl.parallel.SyncBatchNorm` (statistics of the global
    batch).

    Args:
        num_features: the number of channels C.
        eps: added to the variance.
        momentum: weight of the batch in the running statistics' update, or None.
        affine: learn ``weight`` (ones) and ``bias`` (zeros) of shape ``(C,)``.
        track_running_stats: keep running statistics (and use them in eval mode).
        dtype: parameter and buffer dtype (float32 by default).
    """

    ranks: tuple[int, ...] = ()  # accepted input ranks; () is any >= 2

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 dtype: Any = None) -> None:
        super().__init__()
        if num_features <= 0:
            raise ValueError(f"{type(self).__name__} needs num_features > 0, got {num_features}")
        dtype = default_dtype(dtype)
        self.num_features, self.eps = int(num_features), float(eps)
        self.momentum = None if momentum is None else float(momentum)
        self.affine, self.track_running_stats = bool(affine), bool(track_running_stats)
        if affine:
            self.weight = Parameter(init.ones((num_features,), dtype))
            self.bias = Parameter(init.zeros((num_features,), dtype))
        else:
            self.weight = self.bias = None
        if track_running_stats:
            self.register_buffer("running_mean", init.zeros((num_features,), dtype))
            self.register_buffer("running_var", init.ones((num_features,), dtype))
            self.register_buffer("num_batches_tracked", numpy.zeros((), dtype=numpy.int64))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def reset_running_stats(self) -> None:
        """Running mean 0, variance 1, no batches tracked (in place)."""
        if self.track_running_stats:
            self.running_mean[...] = 0
            self.running_var[...] = 1
            self.num_batches_tracked[...] = 0

    def _check_input(self, x: Any) -> None:
        name = type(self).__name__
        if self.ranks and x.ndim not in self.ranks:
            want = " or ".join(str(r) for r in self.ranks)
            raise ValueError(f"{name}: input of shape {tuple(x.shape)} must have {want} "
                             "dimensions (B, C, ...)")
        if x.ndim < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"{name}({self.num_features}): input of shape {tuple(x.shape)} "
                             f"must have {self.num_features} channels on axis 1")

    def _momentum(self) -> float:
        """The running statistics' update weight for this batch (counts the batch)."""
        if not (self.training and self.track_running_stats):
            return 0.0
        self.num_batches_tracked += 1  # in place: a loaded state_dict keeps the array
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def _normalize(self, x: Any, allreduce: Any = None) -> Tensor:
        self._check_input(x)
        batch_stats = self.training or not self.track_running_stats
        track = self.training and self.track_running_stats
        return F.batch_norm(x, self.running_mean if (track or not batch_stats) else None,
                            self.running_var if (track or not batch_stats) else None,
                            self.weight, self.bias, training=batch_stats,
                            momentum=self._momentum(), eps=self.eps, allreduce=allreduce)

    def forward(self, x: Any) -> Tensor:
        return self._normalize(x)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")


class BatchNorm1d(BatchNorm):
    """:class:`BatchNorm` of ``(B, C)`` or ``(B, C, L)``."""

    ranks = (2, 3)


class BatchNorm2d(BatchNorm):
    """:class:`BatchNorm` of ``(B, C, H, W)``."""

    ranks = (4,)


class BatchNorm3d(BatchNorm):
    """:class:`BatchNorm` of ``(B, C, D, H, W)``."""

    ranks = (5,)
