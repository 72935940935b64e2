"""Dynamic loss scaling for float16 training (Micikevicius et al. 2018, "Mixed Precision
Training"; the policy of PyTorch's GradScaler).

float16 gradients below 6e-8 round to zero: backward runs on the loss times a large
``scale`` so that they do not, and the optimizer sees them divided by it again. A step
whose scaled gradients overflow is skipped and the scale halved; after
``growth_interval`` good steps in a row it doubles, to stay as large as is safe::

    scaler = DynamicLossScale()
    dp.backward(loss, global_count=n, scale=scaler.scale)
    finite = ...                      # agreed across ranks (the trainer's guard)
    scaler.update(finite)
    if finite:
        unscale_(params, scaler)      # grads /= scale, in place
        opt.step()

The state is two numbers, checkpointed with the run, so a resume continues bit for bit.
"""
from __future__ import annotations

from typing import Any, Iterable


class DynamicLossScale:
    """The scale and its update rule.

    Args:
        init: the first scale (2**16, as GradScaler).
        factor: the scale is divided by it on overflow and multiplied on growth.
        growth_interval: good steps in a row before the scale grows.
        min_scale: the scale never falls below it.
    """

    def __init__(self, init: float = 2.0 ** 16, factor: float = 2.0,
                 growth_interval: int = 2000, min_scale: float = 1.0) -> None:
        if not (init >= min_scale > 0 and factor > 1 and growth_interval >= 1):
            raise ValueError(f"DynamicLossScale(init={init}, factor={factor}, growth_interval="
                             f"{growth_interval}, min_scale={min_scale}): need init >= "
                             "min_scale > 0, factor > 1, growth_interval >= 1")
        self.scale = float(init)
        self.factor, self.growth_interval, self.min_scale = factor, growth_interval, min_scale
        self.good_steps = 0

    @property
    def at_minimum(self) -> bool:
        """The scale can back off no further: an overflow now is not the scale's doing."""
        return self.scale <= self.min_scale

    def update(self, finite: bool) -> bool:
        """Back off after a non-finite step, grow after enough good ones; True if the
        scale changed. Every rank must pass the same (agreed) ``finite``."""
        if not finite:
            self.good_steps = 0
            old, self.scale = self.scale, max(self.scale / self.factor, self.min_scale)
            return self.scale != old
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.good_steps = 0
            self.scale *= self.factor
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def unscale_(params: Iterable[Any], scaler: DynamicLossScale) -> None:
    """Divide every gradient by the scale, in place (before clipping and the step)."""
    inverse = 1.0 / scaler.scale
    for p in params:
        if p.grad is not None:
            p.grad *= inverse
