"""A fixed affine map per value position: standardise inputs, or undo it on outputs.

A table's columns come in their own units (the wine data: hue about 1, proline about
1,000; the diabetes targets about 150 with a spread of 77). Trained on them raw, the
weights of the large columns dominate the first layer's output and a regression head
must first learn to output numbers a hundred times its initial scale; Adam's step of
about ``lr`` per parameter takes ~150,000 steps to move a bias by 150. Standardised
(z = (x - mean) / std, as scikit-learn's ``StandardScaler``), every column starts on an
equal footing and targets are of order 1. The statistics are the train split's
(:func:`mpidl.data.stats.column_stats`), kept as buffers, so checkpoints carry them and a
model scores new data with the scale it was trained with.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn.module import Module


class Standardize(Module):
    """``(x - mean) / std`` per value position of a sample, or its inverse
    ``x * std + mean`` (``inverse=True``: outputs predicted in standard units, returned in
    the data's). Not trained: ``mean`` and ``std`` are buffers.

    A position without statistics (None, or not finite) keeps its value (mean 0); one of
    standard deviation 0 or None (a constant column) is only centred (std 1).

    The buffers never change in training (``constant_buffers``): data parallelism does
    not broadcast them each step as it does batch norm's running statistics.

    Args:
        mean, std: one number per value position of a sample (a sample of shape
            ``(C, H, W)`` has ``C*H*W``; its values are read in C order).
        inverse: undo the standardisation instead.
        dtype: the buffers' dtype (float32 by default).
    """

    constant_buffers = True

    def __init__(self, mean: Sequence[float | None], std: Sequence[float | None], *,
                 inverse: bool = False, dtype: Any = None) -> None:
        super().__init__()
        if len(mean) != len(std) or not len(mean):
            raise ValueError(f"Standardize: {len(mean)} means and {len(std)} standard "
                             "deviations; one of each per value position, at least one")
        m = numpy.array([numpy.nan if v is None else v for v in mean], numpy.float64)
        s = numpy.array([numpy.nan if v is None else v for v in std], numpy.float64)
        known = numpy.isfinite(m)
        m = numpy.where(known, m, 0.0)
        s = numpy.where(known & numpy.isfinite(s) & (s > 0), s, 1.0)
        dtype = numpy.dtype(dtype or numpy.float32)
        self.inverse = bool(inverse)
        self.register_buffer("mean", m.astype(dtype))
        self.register_buffer("std", s.astype(dtype))

    @classmethod
    def of(cls, stats: tuple | None, width: int, what: str, *, inverse: bool = False,
           dtype: Any = None) -> "Standardize | None":
        """A Standardize from ``stats = (mean, std)`` checked to hold ``width`` values
        (``what`` names them in the error), or None when ``stats`` is None."""
        if stats is None:
            return None
        if len(stats[0]) != width:
            raise ValueError(f"{what}: {len(stats[0])} statistics for a width of {width}")
        return cls(*stats, inverse=inverse, dtype=dtype)

    def forward(self, x: Any) -> Tensor:
        shape = tuple(x.shape)
        width = int(numpy.prod(shape[1:]))  # not -1: the batch may be empty on some rank
        if width != self.mean.shape[0]:
            raise ValueError(f"Standardize({self.mean.shape[0]}): input of shape {shape} has "
                             f"{width} values per sample")
        flat = F.reshape(x, (shape[0], width)) if len(shape) != 2 else x
        if not isinstance(flat, Tensor) and flat.dtype != self.mean.dtype:
            flat = flat.astype(self.mean.dtype)  # integer or wider inputs: the model's dtype
        if self.inverse:
            out = F.add(F.mul(flat, self.std), self.mean)
        else:
            out = F.div(F.sub(flat, self.mean), self.std)
        return F.reshape(out, shape) if len(shape) != 2 else out

    def extra_repr(self) -> str:
        return f"{self.mean.shape[0]}{', inverse' if self.inverse else ''}"
