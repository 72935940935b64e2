"""A small 3-D CNN in the spirit of MLPerf HPC CosmoFlow (the reference ``cosmoflow``).

The MLPerf reference (mlcommons/hpc ``cosmoflow/models/cosmoflow.py``) reads 128^3
volumes of 4 redshift bins through 5 blocks of ``Conv3D(kernel 2, 'same') -> LeakyReLU
-> MaxPool3D(2)`` with 32, 64, ..., 512 channels, flattens the 4^3 x 512 map and
regresses 4 cosmological parameters through Dense 128 -> Dense 64 -> Dense(4, tanh) x 1.2
(dropout 0.5 on the dense layers). This model is that architecture sized by the data:
``in_shape`` sets the input (the default is a CPU-sized 4 x 32^3), the number of blocks
halves the smallest side down to 4 (5 blocks at 128^3: the reference), and ``outputs``
sets the width of the last layer. Batch norm after each convolution is optional (off,
as in the reference's default configuration).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.models.cnn import as_batch, sample_shape
from mpidl.nn import init
from mpidl.nn.activation import LeakyReLU
from mpidl.nn.array import Flatten
from mpidl.nn.container import Sequential
from mpidl.nn.conv import Conv3d
from mpidl.nn.dropout import Dropout
from mpidl.nn.linear import Linear
from mpidl.nn.module import Module, default_dtype
from mpidl.nn.norm import BatchNorm3d
from mpidl.nn.pool import MaxPool3d
from mpidl.nn.standardize import Standardize


def default_blocks(in_shape: Sequence[int]) -> int:
    """Blocks that halve the smallest side down to 4 (at least 1): 5 for 128^3."""
    side = min(in_shape[1:])
    return max(1, int(math.log2(side / 4))) if side >= 8 else 1


class CosmoFlow(Module):
    """CosmoFlow-like 3-D CNN: conv blocks, flatten, three dense layers.

    Parameters ``features.<i>.*`` (``Conv3d`` and, with ``batch_norm``, ``BatchNorm3d``
    per block) and ``head.<i>.*`` (the dense layers). Input ``(B, C, D, H, W)`` (or
    ``(B, D, H, W)`` / flattened samples), output ``(B, outputs)``.

    Args:
        in_shape: one sample's shape, ``(C, D, H, W)``, or ``(D, H, W)`` for one channel.
        outputs: output width: regression targets (4 in the reference) or classes.
        blocks: conv blocks (None: halve the smallest side down to 4).
        base_channels: channels of the first block, doubled per block.
        kernel_size: the convolutions' kernel ('same' padding; 2 in the reference).
        hidden: widths of the dense layers before the output.
        dropout: dropout probability after each hidden dense layer (0.5 in the reference).
        batch_norm: a ``BatchNorm3d`` after each convolution.
        output_scale: ``tanh(y) * output_scale`` on the output (1.2 in the reference, for
            targets normalised to [-1, 1]); None keeps the last layer linear (logits, or
            unbounded targets).
        target_stats: ``(mean, std)`` per regression target: the head predicts standard
            units, returned in the targets' (buffers ``targets.*``; not with
            ``output_scale``, whose bound is in the targets' own units).
        negative_slope: the LeakyReLU slope: 0.3, Keras' default, which the reference's
            ``hidden_activation='LeakyReLU'`` gets (PyTorch's default would be 0.01).
        seed, rng: where the initial values (and the dropout masks) come from.
        dtype: parameter dtype (float32 by default).
    """

    def __init__(self, in_shape: Sequence[int] = (4, 32, 32, 32), outputs: int = 4,
                 blocks: int | None = None, base_channels: int = 32, kernel_size: int = 2,
                 hidden: Sequence[int] = (128, 64), dropout: float = 0.0,
                 batch_norm: bool = False, output_scale: float | None = None,
                 negative_slope: float = 0.3, *, target_stats: tuple | None = None,
                 seed: int | None = None,
                 rng: numpy.random.Generator | None = None, dtype: Any = None) -> None:
        super().__init__()
        self.in_shape = sample_shape(in_shape, 3, "cosmoflow")
        self.outputs = int(outputs)
        self.blocks = default_blocks(self.in_shape) if blocks is None else int(blocks)
        if self.outputs < 1 or self.blocks < 1 or base_channels < 1:
            raise ValueError(f"cosmoflow: outputs={outputs}, blocks={blocks} and "
                             f"base_channels={base_channels} must be positive")
        spatial = list(self.in_shape[1:])
        if min(spatial) < 2 ** self.blocks:
            raise ValueError(f"cosmoflow: {self.blocks} blocks halve the input "
                             f"{self.blocks} times, but in_shape={self.in_shape} has a side "
                             f"of {min(spatial)}; pass blocks <= "
                             f"{int(math.log2(min(spatial))) if min(spatial) > 1 else 0}")
        rng = init.make_rng(seed, rng)
        self.dtype = default_dtype(dtype)
        self.output_scale = None if output_scale is None else float(output_scale)
        layers: list[Module] = []
        c = self.in_shape[0]
        for i in range(self.blocks):
            width = base_channels * 2 ** i
            layers.append(Conv3d(c, width, kernel_size, padding="same", bias=not batch_norm,
                                 rng=rng, dtype=self.dtype))
            if batch_norm:
                layers.append(BatchNorm3d(width, dtype=self.dtype))
            # The reference's LeakyReLU -> MaxPool3d, swapped: the same function (a max
            # commutes with an increasing activation; the gradient reaches the same
            # element) with the activation on an eighth of the values. A negative
            # slope is not increasing: then the reference's order.
            act = LeakyReLU(negative_slope)
            layers += [MaxPool3d(2), act] if negative_slope >= 0 else [act, MaxPool3d(2)]
            spatial = [s // 2 for s in spatial]
            c = width
        layers.append(Flatten())
        self.features = Sequential(*layers)
        dense: list[Module] = []
        width = c * math.prod(spatial)
        for h in hidden:
            dense += [Linear(width, h, rng=rng, dtype=self.dtype), LeakyReLU(negative_slope)]
            if dropout:
                dense.append(Dropout(dropout, rng=rng))
            width = h
        dense.append(Linear(width, self.outputs, rng=rng, dtype=self.dtype))
        self.head = Sequential(*dense)
        if target_stats is not None and self.output_scale is not None:
            raise ValueError("cosmoflow: output_scale bounds the outputs in the targets' own "
                             "units; it does not combine with target_stats (standard units)")
        self.targets = Standardize.of(target_stats, self.outputs, "cosmoflow targets",
                                      inverse=True, dtype=self.dtype)

    def forward(self, x: Any) -> Tensor:
        x = as_batch(x, self.in_shape, self.dtype, "cosmoflow")  # (B, C, D, H, W)
        y = self.head(self.features(x))  # (B, C' D' H' W') -> (B, outputs)
        if self.output_scale is not None:
            y = F.mul(F.tanh(y), self.output_scale)
        return y if self.targets is None else self.targets(y)

    def extra_repr(self) -> str:
        return f"in_shape={self.in_shape}, outputs={self.outputs}, blocks={self.blocks}"
