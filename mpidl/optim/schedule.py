"""Learning-rate schedules as pure functions of the step.

A schedule holds no state: the learning rate at step ``s`` is a function of ``s`` and the
configuration, so a resumed run gets exactly the rates it would have had, with nothing to
checkpoint but the step. Set it before each optimizer step::

    for step in range(start, total_steps):
        opt.lr = warmup_cosine(step, total_steps, warmup_steps, base_lr)
        ...
        opt.step()
"""
from __future__ import annotations

import math


def _check(step: int, total_steps: int, warmup_steps: int) -> None:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"warmup_steps must be in [0, total_steps={total_steps}], got {warmup_steps}"
        )


def _warmup(step: int, warmup_steps: int, base_lr: float) -> float:
    # Step 0 already trains at base_lr / warmup_steps (not 0: a step at rate 0 is wasted),
    # and the last warm-up step reaches base_lr.
    return base_lr * (step + 1) / warmup_steps


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, base_lr: float,
                  min_lr: float = 0.0) -> float:
    """Linear warm-up to ``base_lr``, then cosine decay to ``min_lr`` (Loshchilov & Hutter 2017).

    Args:
        step: the 0-based index of the optimizer step about to be taken.
        total_steps: the length of the schedule; steps at or after it get ``min_lr``.
        warmup_steps: steps ``0 .. warmup_steps - 1`` rise linearly to ``base_lr``.
        base_lr: the peak learning rate.
        min_lr: the final learning rate.
    """
    _check(step, total_steps, warmup_steps)
    if step < warmup_steps:
        return _warmup(step, warmup_steps, base_lr)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def warmup_linear(step: int, total_steps: int, warmup_steps: int, base_lr: float,
                  min_lr: float = 0.0) -> float:
    """Linear warm-up to ``base_lr``, then linear decay to ``min_lr`` at ``total_steps``.

    Arguments as :func:`warmup_cosine`.
    """
    _check(step, total_steps, warmup_steps)
    if step < warmup_steps:
        return _warmup(step, warmup_steps, base_lr)
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return base_lr + (min_lr - base_lr) * progress


def linear_scaling_rule(base_lr: float, global_batch: int, base_batch: int = 256) -> float:
    """The learning rate for ``global_batch``, scaled from ``base_lr`` tuned at ``base_batch``.

    Goyal et al. (2017), "Accurate, Large Minibatch SGD": when the minibatch grows by
    k, multiply the learning rate by k (and warm up over the first epochs). With N ranks
    of batch b, ``global_batch = N * b``.
    """
    if global_batch <= 0 or base_batch <= 0:
        raise ValueError(
            f"batch sizes must be > 0, got global_batch={global_batch}, base_batch={base_batch}"
        )
    return base_lr * global_batch / base_batch
