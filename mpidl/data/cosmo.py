"""A generated scientific regression task: 3-D Gaussian random fields and their spectra.

CosmoFlow (MLPerf HPC) regresses cosmological parameters from 3-D dark-matter volumes.
Here each sample is a Gaussian random field on a ``side``-cubed grid whose power
spectrum is ``P(k) = A k**n``: complex white noise is multiplied by ``sqrt(P(k))`` and
transformed back (the recipe of tools21cm and FyeldGenerator, in
shared/research/science-and-planner.md section 1), and the targets are the two
parameters, amplitude ``A`` and slope ``n``, each scaled to [-1, 1]. The amplitude sets
the field's variance, the slope its smoothness: a 3-D CNN can read both, a mean or a
histogram of the values only the first. Gaussian fields lack the non-Gaussian
structure of N-body volumes; the task exercises the path (HDF5 volumes, 3-D
convolutions, regression, R²), not the physics.
"""
from __future__ import annotations

import os
from typing import Any

import numpy

AMPLITUDE = (0.5, 2.0)   # A's range (log-uniform)
SLOPE = (-3.0, -1.0)     # n's range (uniform)


def _scale(v: numpy.ndarray, lo: float, hi: float) -> numpy.ndarray:
    return (2 * (v - lo) / (hi - lo) - 1).astype(numpy.float32)


def generate_fields(num: int, side: int = 16, seed: int = 0
                    ) -> tuple[numpy.ndarray, numpy.ndarray]:
    """``(fields (num, 1, side, side, side) float32, targets (num, 2) float32)``."""
    rng = numpy.random.default_rng(seed)
    log_a = rng.uniform(numpy.log(AMPLITUDE[0]), numpy.log(AMPLITUDE[1]), num)
    n = rng.uniform(*SLOPE, num)
    freq = numpy.fft.fftfreq(side) * side
    kx, ky, kz = numpy.meshgrid(freq, freq, freq, indexing="ij")
    k = numpy.sqrt(kx * kx + ky * ky + kz * kz)
    k[0, 0, 0] = 1.0  # the mean mode: zeroed below
    fields = numpy.empty((num, 1, side, side, side), dtype=numpy.float32)
    for start in range(0, num, 256):  # in blocks: the complex noise of 256 volumes at once
        stop = min(start + 256, num)
        noise = (rng.standard_normal((stop - start, side, side, side))
                 + 1j * rng.standard_normal((stop - start, side, side, side)))
        amp = numpy.sqrt(numpy.exp(log_a[start:stop])[:, None, None, None]
                         * k[None] ** n[start:stop, None, None, None])
        amp[:, 0, 0, 0] = 0.0
        # side**1.5 undoes ifftn's 1/N normalisation of white noise; 6 brings the fields'
        # standard deviation near 1 (0.1-0.3 before) for the network's first layer.
        field = numpy.fft.ifftn(noise * amp, axes=(1, 2, 3)).real * side ** 1.5 * 6
        fields[start:stop, 0] = field
    targets = numpy.stack([_scale(log_a, *numpy.log(AMPLITUDE)), _scale(n, *SLOPE)], axis=1)
    return fields, targets


def write_cosmo(out_dir: str, num_train: int, num_test: int, side: int, seed: int
                ) -> dict[str, Any]:
    """Generate the fields and write them as a dataset (``x`` volumes, ``y`` targets)."""
    from mpidl.data.writer import write_shards

    x, y = generate_fields(num_train + num_test, side, seed)
    metadata = {"source": "mpidl.data.cosmo.generate_fields", "seed": seed, "side": side,
                "targets": ["log amplitude, scaled to [-1, 1]", "slope n, scaled to [-1, 1]"],
                "amplitude_range": list(AMPLITUDE), "slope_range": list(SLOPE)}
    return write_shards(os.fspath(out_dir), {"x": x[:num_train], "y": y[:num_train]},
                        test_arrays={"x": x[num_train:], "y": y[num_train:]}, labels=None,
                        metadata=metadata, shuffle=False)
