"""The gradient noise scale: how large a batch still helps (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training", appendix A.1).

With per-sample gradients of mean ``G`` and covariance ``Sigma``, a batch of ``b``
samples has ``E|G_b|^2 = |G|^2 + tr(Sigma) / b``. The *simple noise scale*
``B_simple = tr(Sigma) / |G|^2`` is the batch at which the noise in a step equals its
signal: below it a larger batch cuts the steps to a target loss almost in proportion,
beyond it hardly at all (steps ~ S_min (1 + B_noise / B)).

Data parallelism measures both batch sizes for free. Each rank's gradient before the
exchange is a small-batch estimate (its ``b_r`` samples), the averaged one a large-batch
estimate (all ``B``). With ``m = mean_r |G_{b_r}|^2`` and ``k = mean_r 1 / b_r``::

    tr(Sigma) = (m - |G_B|^2) / (k - 1 / B)        |G|^2 = |G_B|^2 - tr(Sigma) / B

are unbiased (the paper's estimators, with unequal shares). Each is noisy per step, so
both are smoothed by an exponential moving average before their ratio is taken, as the
paper does. A rank's squared norm is one dot product per parameter in backward's hooks
(:class:`LocalGradients`), and the ranks' sums one extra allreduce of two numbers.
"""
from __future__ import annotations

import math

from typing import Any, Iterable

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module


class NoiseScale:
    """Smoothed estimates of ``tr(Sigma)``, ``|G|^2`` and their ratio ``B_simple``.

    Args:
        decay: the moving averages' weight of the past per update (0.99: about the last
            hundred steps; with 0.9 the estimate of ``|G|^2``, small once the loss
            flattens, went negative in the second half of a reviews epoch).
    """

    def __init__(self, decay: float = 0.99) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} must be in [0, 1)")
        self.decay = decay
        self.trace: float | None = None   # smoothed tr(Sigma)
        self.signal: float | None = None  # smoothed |G|^2

    def update(self, small_sq: float, inv_small: float, big_sq: float,
               big_batch: int) -> float | None:
        """One step's estimates; returns the smoothed ``B_simple`` (None while the
        smoothed ``|G|^2`` is not positive).

        Args:
            small_sq: the ranks' mean squared norm of their own mean gradients.
            inv_small: the ranks' mean of ``1 / b_r``.
            big_sq: the squared norm of the averaged (global mean) gradient.
            big_batch: the samples of the whole step, ``B``.
        """
        spread = inv_small - 1.0 / big_batch
        if not spread > 0:
            return self.value  # one rank, or every rank has the whole batch
        trace = (small_sq - big_sq) / spread
        signal = big_sq - trace / big_batch
        a = self.decay
        self.trace = trace if self.trace is None else a * self.trace + (1 - a) * trace
        self.signal = signal if self.signal is None else a * self.signal + (1 - a) * signal
        return self.value

    @property
    def value(self) -> float | None:
        """The smoothed ``B_simple``, or None."""
        if self.signal is None or not self.signal > 0 or not math.isfinite(self.signal) \
                or not math.isfinite(self.trace):
            return None  # a diverging run's overflowed norms: no estimate
        return self.trace / self.signal

    def state_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("trace", self.trace), ("signal", self.signal))
                if v is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trace = float(state["trace"]) if "trace" in state else None
        self.signal = float(state["signal"]) if "signal" in state else None


class LocalGradients:
    """This rank's squared gradient norm before data parallelism averages it.

    Registers a post-accumulate hook on each parameter *before* the wrapper does (hooks
    run in registration order), so it reads a gradient once final and before its bucket
    is sent. Collects per backward; :meth:`take` returns the sum and starts over.
    """

    def __init__(self, params: Iterable[Tensor]) -> None:
        self.total: Any = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in params if p.requires_grad]

    def _on_grad(self, p: Tensor) -> None:
        g = p.grad
        if g is None:
            return
        xp = get_array_module(g)
        flat = g.reshape(-1).astype(xp.promote_types(g.dtype, xp.float32), copy=False)
        sq = xp.dot(flat, flat)
        self.total = sq if self.total is None else self.total + sq

    def take(self) -> float:
        """The squared norm summed since the last call (0 when no gradient came)."""
        total = self.take_raw()
        return total if isinstance(total, float) else float(total)

    def take_raw(self) -> Any:
        """As :meth:`take`, left where it was summed (a 0-d xp array, or 0.0): the
        step reads it with its other values, in one host read (#48)."""
        total, self.total = self.total, None
        return 0.0 if total is None else total

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["NoiseScale", "LocalGradients"]
