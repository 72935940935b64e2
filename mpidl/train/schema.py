"""Typed configuration tables from dataclasses: checked updates from TOML and the command line.

The schema *is* the dataclass (:class:`mpidl.train.config.Config`): its fields are the
keys, their annotations the types (``int``, ``float``, ``bool``, ``str``, unions of them
with ``None``), a dataclass-typed field is a nested table. Field metadata adds:

* ``choices``: the allowed values (:func:`choices`);
* ``extra``: on a ``dict`` field, the table takes any other key into that dict (a
  model's keyword arguments);
* ``main``: on a table field, the key that a scalar sets (``model = "bow"`` sets
  ``model.name``).

Values are checked strictly: a bool is not an int, an int is a fine float (and becomes
one), a ``str`` field takes only strings. Errors are :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from typing import Any, Sequence, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration key or value that the schema rejects; the message names the key."""


def choices(*values: str, default: str) -> Any:
    """A ``str`` field that takes one of ``values``."""
    return dataclasses.field(default=default, metadata={"choices": values})


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _extra_field(cls: type) -> str | None:
    return next((f.name for f in dataclasses.fields(cls) if f.metadata.get("extra")), None)


def _keys(cls: type) -> list[str]:
    extra = _extra_field(cls)
    return [k for k in _fields(cls) if k != extra]


def options(tp: Any) -> tuple[Any, ...]:
    """The types a field accepts: ``Optional[int]`` -> ``(int, NoneType)``."""
    origin = typing.get_origin(tp)
    if origin is Union or origin is getattr(types, "UnionType", Union):
        return typing.get_args(tp)
    return (tp,)


def _type_name(tp: Any) -> str:
    return " or ".join("none" if t is type(None) else getattr(t, "__name__", str(t))
                       for t in options(tp))


def _accepts(t: Any, value: Any) -> bool:
    if t is type(None):
        return value is None
    if t is bool:
        return isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, t)


def check_value(key: str, tp: Any, value: Any, field: dataclasses.Field | None = None) -> Any:
    """``value`` as type ``tp`` (ints become floats for a float), or a ConfigError."""
    for t in options(tp):
        if _accepts(t, value):
            value = float(value) if t is float else value
            break
    else:
        raise ConfigError(
            f"config key {key!r}: {value!r} is a {type(value).__name__}, expected {_type_name(tp)}")
    allowed = field.metadata.get("choices") if field is not None else None
    if allowed and value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"config key {key!r}: {value!r} is not one of {list(allowed)}{hint}")
    return value


def parse_literal(text: str) -> Any:
    """Command-line text read as a TOML value (``64``, ``0.1``, ``true``, ``[1, 2]``),
    else a str."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def parse_text(key: str, tp: Any, text: str) -> Any:
    """Command-line text for a field of type ``tp`` (``none`` for None);
    ConfigError if none fits."""
    low = text.strip().lower()
    for t in options(tp):
        if t is type(None) and low in ("none", "null"):
            return None
    for t in options(tp):
        if t is bool and low in _TRUE | _FALSE:
            return low in _TRUE
        if t in (int, float):
            try:
                return t(text)
            except ValueError:
                pass
        if t is str:
            return text
    raise ConfigError(f"config key {key!r}: cannot read {text!r} as {_type_name(tp)}")


def unknown_key(key: str, known: Sequence[str]) -> ConfigError:
    """The error for an unknown ``key``, with the close matches among ``known``."""
    prefix, _, leaf = key.rpartition(".")
    prefix = prefix + "." if prefix else ""
    close = difflib.get_close_matches(leaf, list(known), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(prefix + c) for c in close)}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint} (known: {', '.join(sorted(known))})")


def _same_kind(old: Any, new: Any) -> bool:
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, float):
        return isinstance(new, (int, float))
    return isinstance(new, type(old))


def apply_table(obj: Any, table: dict, prefix: str = "") -> None:
    """Set the fields of dataclass ``obj`` from a parsed TOML table, checking every key."""
    cls = type(obj)
    hints, fields_, extra = _hints(cls), _fields(cls), _extra_field(cls)
    for key, value in table.items():
        full = prefix + key
        if key in fields_ and key != extra:
            tp = hints[key]
            if dataclasses.is_dataclass(tp):
                if not isinstance(value, dict):      # `model = "bow"` sets model.name
                    value = {fields_[key].metadata["main"]: value}
                apply_table(getattr(obj, key), value, full + ".")
            else:
                setattr(obj, key, check_value(full, tp, value, fields_[key]))
        elif extra is not None:
            kwargs = getattr(obj, extra)
            if key in kwargs and not _same_kind(kwargs[key], value):
                raise ConfigError(f"config key {full!r}: {value!r} is a {type(value).__name__}, "
                                  f"expected {type(kwargs[key]).__name__} like {kwargs[key]!r}")
            kwargs[key] = value
        else:
            raise unknown_key(full, _keys(cls))


def _lookup(root: Any, key: str) -> tuple[Any, str, Any, str]:
    """``(table object, field name, type or None for an extra key, prefix)`` of a dotted key."""
    obj, prefix = root, ""
    parts = key.split(".")
    for i, part in enumerate(parts):
        cls = type(obj)
        fields_, last = _fields(cls), i == len(parts) - 1
        if part in _keys(cls):
            tp = _hints(cls)[part]
            if dataclasses.is_dataclass(tp):
                obj, prefix = getattr(obj, part), prefix + part + "."
                if last:                          # --model=bow is --model.name=bow
                    main = fields_[part].metadata["main"]
                    return obj, main, _hints(type(obj))[main], prefix
                continue
            if not last:
                raise ConfigError(f"config key {prefix + part!r} is not a table; "
                                  f"cannot set {key!r}")
            return obj, part, tp, prefix
        if _extra_field(cls) is not None and last:
            return obj, part, None, prefix
        if _extra_field(cls) is not None:
            raise ConfigError(f"config key {key!r}: {prefix.rstrip('.')} options are "
                              f"one level deep")
        raise unknown_key(prefix + part, _keys(cls))
    raise ConfigError(f"empty config key {key!r}")


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, str | None]]:
    """``["--a=1", "--b", "2", "--flag"]`` -> ``[("a", "1"), ("b", "2"), ("flag", None)]``.

    Dashes in keys become underscores. A key followed by another ``--key`` (or by
    nothing) has no value: :func:`apply_overrides` reads that as true for a bool key.
    """
    out: list[tuple[str, str | None]] = []
    args = list(overrides)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"expected --key=value, got {arg!r} (a preset or config file "
                              "must come first)")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            out.append((key, value))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append((key, args[i + 1]))
            i += 1
        else:
            out.append((key, None))
        i += 1
    return out


def apply_overrides(root: Any, overrides: Sequence[str]) -> Any:
    """Apply ``--key=value`` / ``--key value`` / ``--flag`` / ``--no-flag`` to ``root``;
    return it."""
    for key, text in parse_overrides(overrides):
        head, _, leaf = key.rpartition(".")
        if text is None and leaf.startswith("no_"):
            # --no-trace is --trace=false, when `trace` is a bool key
            plain = (head + "." if head else "") + leaf[3:]
            try:
                tp = _lookup(root, plain)[2]
            except ConfigError:
                tp = None
            if tp is not None and bool in options(tp):
                key, text = plain, "false"
        obj, name, tp, prefix = _lookup(root, key)
        if tp is None:                            # an extra key: a TOML literal
            value = True if text is None else parse_literal(text)
        elif text is None:
            if bool not in options(tp):
                raise ConfigError(f"config key {prefix + name!r} needs a value: "
                                  f"--{prefix + name}=VALUE")
            value = True
        else:
            value = parse_text(prefix + name, tp, text)
        apply_table(obj, {name: value}, prefix)
    return root


# -- writing TOML ----------------------------------------------------------------------

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)   # JSON escapes are valid TOML escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return ("{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items())
                + " }")
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def _toml_key(key: str) -> str:
    bare = key and key.isascii() and all(c.isalnum() or c in "_-" for c in key)
    return key if bare else json.dumps(key)


def _table_lines(obj: Any) -> list[str]:
    lines = []
    extra = _extra_field(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name == extra:
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()]
        elif value is None:
            lines.append(f"# {f.name} = none")   # TOML has no null: absent means none
        elif not dataclasses.is_dataclass(value):
            lines.append(f"{f.name} = {_toml_value(value)}")
    return lines


def to_toml(root: Any) -> str:
    """A dataclass tree as a TOML document that :func:`apply_table` reads back equal.

    A None value is written as a comment, which reads back as the field's default: an
    optional field's default must be None.
    """
    lines = _table_lines(root)
    for f in dataclasses.fields(root):
        value = getattr(root, f.name)
        if dataclasses.is_dataclass(value):
            lines += ["", f"[{f.name}]"] + _table_lines(value)
    return "\n".join(lines) + "\n"
