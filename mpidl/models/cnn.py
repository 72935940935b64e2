"""A 2-D convolutional network for image-like scientific arrays (the reference ``cnn``).

Blocks of ``Conv2d(3x3, 'same') -> BatchNorm2d -> MaxPool2d(2) -> ReLU``, then global
average pooling and a linear head. The shapes come from the data: ``in_shape`` is one
sample's shape and ``outputs`` the number of classes (or regression targets), so the
same model reads 28x28 digits and 64x64 fields; a block stops pooling once the map is
smaller than 2 on a side, and global pooling makes the head independent of the size.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn import init
from mpidl.nn.activation import ReLU
from mpidl.nn.array import Flatten
from mpidl.nn.container import Sequential
from mpidl.nn.conv import Conv2d
from mpidl.nn.linear import Linear
from mpidl.nn.module import Module, default_dtype
from mpidl.nn.norm import BatchNorm2d
from mpidl.nn.pool import AdaptiveAvgPool2d, MaxPool2d
from mpidl.nn.standardize import Standardize


def sample_shape(in_shape: Any, spatial: int, model: str) -> tuple[int, ...]:
    """``in_shape`` as ``(C, *S)`` with ``spatial`` axes; ``S`` alone means one channel.

    Raises:
        ValueError: not a tuple of positive ints of ``spatial`` or ``spatial + 1`` entries.
    """
    try:
        shape = tuple(int(s) for s in in_shape)
    except TypeError:
        raise ValueError(f"{model}: in_shape={in_shape!r} must be a tuple such as "
                         f"{(1,) + (28,) * spatial}") from None
    if len(shape) == spatial:
        shape = (1,) + shape
    if len(shape) != spatial + 1 or min(shape) < 1:
        raise ValueError(f"{model}: in_shape={tuple(in_shape)} must be (channels, {spatial} "
                         f"spatial sizes) or the {spatial} sizes alone, all positive")
    return shape


def as_batch(x: Any, shape: tuple[int, ...], dtype: Any, model: str) -> Any:
    """``x`` as ``(B, *shape)``: a batch of flattened samples (or of one-channel samples
    without the channel axis) is reshaped; raw arrays are cast to the parameters' dtype
    (integer pixels, float64 fields)."""
    if not isinstance(x, Tensor) and x.dtype != dtype:
        x = x.astype(dtype)
    if tuple(x.shape[1:]) == shape:
        return x
    if x.ndim >= 2 and math.prod(x.shape[1:]) == math.prod(shape):
        return F.reshape(x, (x.shape[0],) + shape)  # not -1: B may be 0 on some rank
    raise ValueError(f"{model}: input of shape {tuple(x.shape)} does not hold samples of "
                     f"in_shape={shape} (build the model with the data's in_shape)")


class CNN(Module):
    """The reference 2-D CNN: conv blocks, batch norm, pooling, a linear head.

    Parameters ``features.<i>.*`` (``Conv2d``, ``BatchNorm2d`` per block) and
    ``head.*``. Input ``(B, C, H, W)`` (or ``(B, H, W)`` / ``(B, C*H*W)`` holding such
    samples), output ``(B, outputs)``.

    Args:
        in_shape: one sample's shape, ``(C, H, W)``, or ``(H, W)`` for one channel.
        outputs: output width: the number of classes, or of regression targets.
        channels: output channels of the blocks, one block each.
        batch_norm: a ``BatchNorm2d`` after each convolution (its bias is then dropped,
            the batch norm's shift replaces it).
        target_stats: ``(mean, std)`` per regression target: the head predicts standard
            units, returned in the targets' (:class:`~mpidl.nn.Standardize`, buffers
            ``targets.*``); None: the head's outputs as they are.
        seed, rng: where the initial values come from (see :mod:`mpidl.nn.init`).
        dtype: parameter dtype (float32 by default).
    """

    def __init__(self, in_shape: Sequence[int] = (1, 28, 28), outputs: int = 10,
                 channels: Sequence[int] = (32, 64, 128), batch_norm: bool = True, *,
                 target_stats: tuple | None = None, seed: int | None = None,
                 rng: numpy.random.Generator | None = None, dtype: Any = None) -> None:
        super().__init__()
        self.in_shape = sample_shape(in_shape, 2, "cnn")
        self.outputs = int(outputs)
        if self.outputs < 1 or not channels or min(channels) < 1:
            raise ValueError(f"cnn: outputs={outputs} and channels={tuple(channels)} must be "
                             "positive (and at least one block)")
        rng = init.make_rng(seed, rng)
        self.dtype = default_dtype(dtype)
        layers: list[Module] = []
        c, size = self.in_shape[0], min(self.in_shape[1:])
        for width in channels:
            layers.append(Conv2d(c, width, 3, padding=1, bias=not batch_norm, rng=rng,
                                 dtype=self.dtype))
            if batch_norm:
                layers.append(BatchNorm2d(width, dtype=self.dtype))
            if size >= 2:
                # Pooling before the ReLU is the same function (a max commutes with a
                # non-decreasing activation, and the gradient reaches the same
                # element), with the ReLU on a quarter of the values.
                layers.append(MaxPool2d(2))
                size //= 2
            layers.append(ReLU())
            c = width
        self.features = Sequential(*layers)
        self.pool = Sequential(AdaptiveAvgPool2d(1), Flatten())
        self.head = Linear(c, self.outputs, rng=rng, dtype=self.dtype)
        self.targets = Standardize.of(target_stats, self.outputs, "cnn targets", inverse=True,
                                      dtype=self.dtype)

    def forward(self, x: Any) -> Tensor:
        x = as_batch(x, self.in_shape, self.dtype, "cnn")  # (B, C, H, W)
        y = self.head(self.pool(self.features(x)))  # (B, C') -> (B, outputs)
        return y if self.targets is None else self.targets(y)

    def extra_repr(self) -> str:
        return f"in_shape={self.in_shape}, outputs={self.outputs}"
