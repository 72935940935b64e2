"""A run's ``[model]`` keys, checked against the model's constructor.

The config schema (:mod:`mpidl.train.config`) cannot know each model's options: ``[model]``
takes any key. Once the model is looked up by name, its factory's signature (and, for a
factory that hands ``**kwargs`` on to the class it returns, that class's constructor) says
which keys exist and of which type, so that ``--model.dimm=64`` is a ConfigError naming
the key and its close matches, and ``--model.dim=big`` one naming the expected type, before
anything is built::

    factory = check_model(config)           # the name, then every model.* key
    accepted = model_parameters(factory)    # what the factory takes, e.g. to fill in keys
"""
from __future__ import annotations

import difflib
import inspect
import typing
from typing import TYPE_CHECKING, Any, Callable, Union

from mpidl.train.schema import ConfigError, check_value, options, unknown_key

if TYPE_CHECKING:
    from mpidl.train.config import Config

__all__ = ["check_model", "check_model_kwargs", "model_parameters"]


def check_model(config: Config) -> Callable[..., Any]:
    """The factory of ``config.model.name``, after checking the name and the model's keys.

    Raises ConfigError (an unknown name with the close matches, or a bad ``model.*``
    key), so that ``mpidl train`` reports it once with exit 2 before building anything.
    """
    # Here: the model zoo (the whole nn engine) loads when a model is checked, not when a
    # config is read (`mpidl train --help`).
    from mpidl import models

    name = config.model.name
    if name not in models.MODELS:
        close = difflib.get_close_matches(name, list(models.MODELS), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ConfigError(f"unknown model {name!r}{hint} (known: "
                          f"{', '.join(sorted(models.MODELS))}; --model=NAME)")
    factory = models.MODELS[name]
    check_model_kwargs(config, factory)
    return factory


def _keyword_parameters(f: Callable[..., Any]) -> tuple[dict, bool, dict]:
    """``f``'s parameters passable by keyword, whether it takes ``**kwargs``, its hints."""
    sig = inspect.signature(f)
    params = {n: p for n, p in sig.parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    try:
        hints = typing.get_type_hints(f)
    except Exception:  # unresolvable annotations: fall back to the defaults' types
        hints = {}
    return params, takes_any, hints


def _model_signature(factory: Callable[..., Any]) -> tuple[dict, bool, dict]:
    """A model factory's keyword parameters, whether it takes any others, their hints."""
    params, takes_any, hints = _keyword_parameters(factory)
    built = hints.pop("return", None)
    if takes_any and isinstance(built, type):
        # A factory that hands **kwargs on to the class it returns (every reference
        # model's does): that class's constructor says which keys exist.
        more, takes_any, more_hints = _keyword_parameters(built.__init__)
        more.pop("self", None)
        params = {**more, **params}
        hints = {**more_hints, **hints}
    return params, takes_any, hints


def model_parameters(factory: Callable[..., Any]) -> set[str]:
    """The keyword arguments a model factory accepts (its own and its class's)."""
    return set(_model_signature(factory)[0])


def check_model_kwargs(config: Config, factory: Callable[..., Any]) -> None:
    """Check ``config.model.kwargs`` against the signature of the model's constructor.

    The schema cannot know each model's options; the trainer calls this once it has
    looked the model up, so that ``--model.dimm=64`` is a ConfigError naming the key and
    the close matches, and ``--model.dim=big`` one naming the expected type (from the
    parameter's annotation or default value), before anything is built.
    """
    params, takes_any, hints = _model_signature(factory)
    for key, value in config.model.kwargs.items():
        full = f"model.{key}"
        if key not in params:
            if takes_any:
                continue
            raise unknown_key(full, list(params))
        tp = hints.get(key)
        if tp is None and params[key].default is not inspect.Parameter.empty \
                and params[key].default is not None:
            tp = type(params[key].default)
        if tp in (int, float, bool, str) or typing.get_origin(tp) is Union:
            if all(t in (int, float, bool, str, type(None)) for t in options(tp)):
                config.model.kwargs[key] = check_value(full, tp, value)
