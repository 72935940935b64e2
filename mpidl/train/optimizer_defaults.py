"""Each optimizer's learning rate, how it grows with the global batch, and its weight
decay, as published.

``mpidl train`` runs at ``lr`` (the rate at ``base_batch``) scaled to ``global_batch``
by ``lr_scaling``. Left at their defaults (``lr = none``, ``lr_scaling = "auto"``,
``weight_decay = none``), all three come from the optimizer's row below, each rule
from its source:

- **linear** (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): lr x batch / base,
  derived for SGD, and the rule LARS was introduced with (You et al. 2017);
- **sqrt** (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
  Algorithms"): lr x sqrt(batch / base), the rule derived for Adam and AdamW; LAMB's
  paper trains with it too, untuned across batch sizes (You et al. 2019, §5: "the
  square root LR scaling rule" with linear-epoch warm-up).

The base rates are for the default ``base_batch = 64``; LARS's and LAMB's were measured
on the reviews task (docs/planning.md, "Large batches"). Weight decay: PyTorch's
defaults for Adam, AdamW and SGD; LARS's 5e-4 is the paper's (You et al. 2017; at 0.01,
AdamW's, the decay inside LARS's momentum shrinks the weights to nothing within a few
large-batch steps here), LAMB's 0.01 its BERT runs' (You et al. 2019). This module
loads no engine: reading a config (``mpidl train --help``, the planner) stays light.
"""
from __future__ import annotations

import math
from typing import NamedTuple


class OptimizerDefaults(NamedTuple):
    """An optimizer's base learning rate (at a batch of 64), scaling rule, weight decay,
    and where they come from."""

    lr: float
    rule: str
    weight_decay: float
    source: str


OPTIMIZER_DEFAULTS: dict[str, OptimizerDefaults] = {
    "adamw": OptimizerDefaults(1e-3, "sqrt", 0.01, "sqrt: Malladi et al. 2022"),
    "adam": OptimizerDefaults(1e-3, "sqrt", 0.0, "sqrt: Malladi et al. 2022"),
    "sgd": OptimizerDefaults(0.1, "linear", 0.0, "linear: Goyal et al. 2017"),
    "lars": OptimizerDefaults(0.1, "linear", 5e-4, "linear, decay: You et al. 2017; lr "
                                                   "measured on reviews"),
    "lamb": OptimizerDefaults(6e-3, "sqrt", 0.01, "sqrt: You et al. 2019 sec. 5; lr "
                                                  "measured on reviews"),
}

RULES = ("linear", "sqrt", "none")


def base_lr(optimizer: str, lr: float | None) -> float:
    """``lr``, or the optimizer's default when it is None."""
    return OPTIMIZER_DEFAULTS[optimizer].lr if lr is None else lr


def weight_decay(optimizer: str, value: float | None) -> float:
    """``value``, or the optimizer's default weight decay when it is None."""
    return OPTIMIZER_DEFAULTS[optimizer].weight_decay if value is None else value


def scaling_rule(optimizer: str, lr_scaling: str) -> str:
    """``lr_scaling``, or the optimizer's rule for ``"auto"``."""
    return OPTIMIZER_DEFAULTS[optimizer].rule if lr_scaling == "auto" else lr_scaling


def scale(lr: float, rule: str, global_batch: int, base_batch: int) -> float:
    """``lr`` (at ``base_batch``) scaled to ``global_batch`` by ``rule``."""
    if rule == "linear":
        # Here: the rule lives with the schedules; reading a config alone never gets here.
        from mpidl.optim.schedule import linear_scaling_rule

        return linear_scaling_rule(lr, global_batch, base_batch)
    if rule == "sqrt":
        return lr * math.sqrt(global_batch / base_batch)
    return lr


def describe() -> str:
    """The table ``mpidl train --help`` shows: each optimizer's defaults and sources."""
    lines = ["Optimizers (--optimizer) and what they get when lr, lr_scaling and "
             "weight_decay are left unset (none, auto, none; lr at base_batch=64):"]
    for name, d in OPTIMIZER_DEFAULTS.items():
        lines.append(f"  {name:6s} lr {d.lr:<6g} scaled {d.rule:6s} weight_decay "
                     f"{d.weight_decay:<6g} ({d.source})")
    lines.append("A preset's lr and weight_decay are for its own optimizer: another "
                 "--optimizer brings its own unless --lr/--weight-decay are given.")
    return "\n".join(lines) + "\n"


__all__ = ["OPTIMIZER_DEFAULTS", "OptimizerDefaults", "RULES", "base_lr", "scaling_rule",
           "scale", "weight_decay", "describe"]
