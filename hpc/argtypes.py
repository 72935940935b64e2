"""Command-line values checked as they are read: one function per rule.

Each public function is an ``argparse`` ``type=``: it returns the converted value or
raises :class:`argparse.ArgumentTypeError` naming the value, the limit and the fix, which
argparse prints as ``PROG: error: argument --opt: MESSAGE`` and exits with status 2,
before the command has done any work (docs/exit-status.md)::

    p.add_argument("--step-time", type=argtypes.positive_float)
    p.add_argument("--json", metavar="FILE", type=argtypes.output_file)

:func:`number_problem` is the one rule for numbers, shared by configuration checks that
are not argparse's (a ``--key=value`` of ``mpidl train``).
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile


def number_problem(value: float, minimum: float, strict: bool) -> str | None:
    """What is wrong with ``value`` as a finite number ``> minimum`` (``strict``) or
    ``>= minimum``: ``"must be a finite number > 0"``, or None when it is fine."""
    if math.isfinite(value) and (value > minimum if strict else value >= minimum):
        return None
    return f"must be a finite number {'>' if strict else '>='} {minimum:g}"


def _number(text: str, kind: type, minimum: float, strict: bool, example: str) -> float:
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an integer' if kind is int else 'a number'}; "
            f"write e.g. {example}") from None
    if kind is int:  # an integer is finite, and "> 0" reads better as ">= 1"
        least = int(minimum) + 1 if strict else int(minimum)
        problem = None if value >= least else f"must be an integer >= {least}"
    else:
        problem = number_problem(value, minimum, strict)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r} {problem} (e.g. {example})")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1: a count of ranks, samples, iterations."""
    return int(_number(text, int, 0, True, "1"))


def nonnegative_int(text: str) -> int:
    """An integer >= 0: a seed, a number of warm-up iterations."""
    return int(_number(text, int, 0, False, "0"))


def positive_float(text: str) -> float:
    """A finite number > 0: seconds, gigabytes, epochs. Not NaN, not infinite."""
    return _number(text, float, 0, True, "0.5")


def nonnegative_float(text: str) -> float:
    """A finite number >= 0: hours of setup or queueing, a fraction that may be 0."""
    return _number(text, float, 0, False, "0")


def output_file(text: str) -> str:
    """A file the command will write: not a directory, in a directory that exists and
    can be written. Checked when the arguments are read, so that an hour of measuring
    does not end in a failed write."""
    if not text:
        raise argparse.ArgumentTypeError("an empty file name; name the file to write")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory; name a file to write (e.g. "
            f"{os.path.join(text, 'out')})")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the directory {parent} does not exist; create it (mkdir -p "
            f"{parent}) or name a file in an existing directory")
    writable = os.access(text, os.W_OK) if os.path.exists(text) else os.access(parent, os.W_OK)
    if not writable:
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be written (permission denied); name a file in a directory "
            "you can write")
    return text


def output_dir_problem(path: str) -> str | None:
    """What stops a command from making or writing the directory ``path`` (a dataset's
    OUT_DIR, a run directory), or None when it can. Checked before any work, so that a
    conversion or a training does not end in a failed write.

    A regular file at ``path`` or on the way to it, and a directory that refuses a new
    file (a read-only filesystem, no permission), are found here. The nearest existing
    directory is tried by creating an unnamed temporary file in it (removed at once):
    unlike ``os.access``, that answers for root too, on NFS with root squash and with
    access control lists. The message starts with the path and ends with the fix.
    """
    if not path:
        return "an empty directory name; name the directory to write"
    if os.path.exists(path) and not os.path.isdir(path):
        return (f"{path!r} is a file, not a directory; name a directory (new or existing) "
                f"to write into, e.g. {path + '.d'!r}")
    existing = os.path.normpath(path)  # named as the user wrote it: relative stays so
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing) or "."
    if not os.path.isdir(existing):
        return (f"{path!r}: {existing!r} is a file, so no directory can be made under it; "
                "name a path whose parents are directories")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        return (f"{path!r}: the directory {existing!r} cannot be written "
                f"({e.strerror or e}); name a directory on a filesystem you can write")
    return None
