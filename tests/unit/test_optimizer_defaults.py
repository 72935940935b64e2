"""The learning rate each optimizer gets by default, and how it grows with the batch:
the published rule per optimizer, and a preset's rate kept only for its own optimizer."""
from __future__ import annotations

import math

import pytest

from mpidl.train.config import load_config
from mpidl.train.optimizer_defaults import OPTIMIZER_DEFAULTS


@pytest.mark.parametrize("optimizer,rule", [("adamw", "sqrt"), ("adam", "sqrt"),
                                            ("lamb", "sqrt"), ("sgd", "linear"),
                                            ("lars", "linear")])
def test_auto_is_the_optimizers_published_rule(optimizer, rule):
    config = load_config(None, [f"--optimizer={optimizer}", "--global-batch=8192",
                                "--base-batch=64", "--lr=0.01"])
    factor = 128 if rule == "linear" else math.sqrt(128)
    assert config.scaled_lr() == pytest.approx(0.01 * factor)
    for explicit, f in (("linear", 128), ("sqrt", math.sqrt(128)), ("none", 1)):
        config.lr_scaling = explicit
        assert config.scaled_lr() == pytest.approx(0.01 * f)


def test_another_optimizer_brings_its_own_rate_unless_one_is_given():
    preset = load_config(None, [])
    assert preset.optimizer == "adamw" and preset.lr == 0.002  # reviews.toml's
    lamb = load_config(None, ["--optimizer=lamb"])
    assert lamb.lr is None and lamb.scaled_lr() == OPTIMIZER_DEFAULTS["lamb"].lr
    lars = load_config(None, ["--optimizer", "lars", "--global-batch=128"])
    assert lars.scaled_lr() == pytest.approx(2 * OPTIMIZER_DEFAULTS["lars"].lr)
    assert lars.decay() == OPTIMIZER_DEFAULTS["lars"].weight_decay != preset.weight_decay
    given = load_config(None, ["--optimizer=lamb", "--lr=0.004", "--weight-decay", "0.1"])
    assert given.lr == 0.004 and given.decay() == 0.1
    same = load_config(None, ["--optimizer=adamw"])
    assert same.lr == 0.002 and same.decay() == 0.01


def test_help_names_every_optimizers_rule_and_source():
    from mpidl.train.command import _help

    text = _help(["--help"])
    for name, d in OPTIMIZER_DEFAULTS.items():
        line = next(l for l in text.splitlines() if l.strip().startswith(name + " "))
        assert d.rule in line and d.source in line
    assert 'lr_scaling = "auto"' in text
