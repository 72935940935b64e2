"""Collective test verdicts: every rank fails together, naming the ranks that failed.

A plain ``assert`` that fails on one rank makes that rank leave the test while the
others wait in the next collective: a hang instead of a failure. So does a
``pytest.raises`` block that does not raise on one rank. These helpers agree on the
verdict first (an allgather) and raise ``AssertionError`` on every rank.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import numpy

from mpidl.backend import as_numpy
from mpidl.testing.tolerance import tolerance


def assert_all_ranks(comm: Any, ok: bool, message: str = "") -> None:
    """Raise AssertionError on every rank if ``ok`` is False on any rank.

    Collective. The error lists each failing rank with its own ``message``.
    """
    verdicts = comm.allgather_obj((bool(ok), "" if ok else str(message)))
    failed = [(r, msg) for r, (good, msg) in enumerate(verdicts) if not good]
    if failed:
        lines = "\n".join(f"  rank {r}: {msg}" for r, msg in failed)
        raise AssertionError(
            f"failed on {len(failed)} of {comm.size} ranks "
            f"({', '.join(str(r) for r, _ in failed)}):\n{lines}"
        )


def describe_mismatch(actual: Any, desired: Any, rtol: float, atol: float) -> str:
    """One line saying where and by how much two arrays differ ('' if they match).

    A NaN matches a NaN (as in ``numpy.testing.assert_allclose``), so a test can say
    where a NaN must arrive; anywhere else a NaN is a difference.
    """
    a, d = as_numpy(actual), as_numpy(desired)
    if a.shape != d.shape:
        return f"shape {a.shape} != expected {d.shape}"
    if a.dtype.kind in "biu" and d.dtype.kind in "biu":
        bad = a != d
    else:
        bad = ~numpy.isclose(a, d, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return ""
    idx = tuple(int(i) for i in numpy.argwhere(bad)[0])
    return (f"{int(bad.sum())} of {a.size} elements differ (rtol={rtol}, atol={atol}); "
            f"first at {idx}: {a[idx]!r} != expected {d[idx]!r}")


def assert_allclose_all_ranks(comm: Any, actual: Any, desired: Any, dtype: Any = None,
                              scale: float = 1.0, what: str = "") -> None:
    """Collective ``assert_allclose`` with the tolerances of :func:`tolerance`.

    Args:
        comm: the communicator whose ranks must all agree.
        actual, desired: arrays (NumPy or CuPy) on this rank.
        dtype: dtype whose tolerance applies (default: ``actual``'s).
        scale: multiplies both tolerances (for long chains of float arithmetic).
        what: a label for the message.
    """
    a = as_numpy(actual)
    rtol, atol = tolerance(dtype if dtype is not None else a.dtype)
    problem = describe_mismatch(a, desired, rtol * scale, atol * scale)
    assert_all_ranks(comm, not problem, f"{what}: {problem}" if what else problem)


class Raised:
    """What :func:`raises_all_ranks` caught on this rank: ``value``, the exception."""

    value: Any = None


@contextlib.contextmanager
def raises_all_ranks(comm: Any, expected: Any, match: str | None = None) -> Iterator[Raised]:
    """Collective ``pytest.raises``: the block must raise ``expected`` on every rank.

    Collective: every rank runs the block and then the verdict, so the block may itself
    hold collectives. Where it raises nothing, raises another exception, or one whose
    message does not match, every rank gets an AssertionError naming those ranks (the
    other exception is chained on its rank); where all raised as expected, the
    exception is swallowed and is ``.value`` of the yielded object.

    Args:
        comm: the communicator whose ranks must all agree.
        expected: an exception class or a tuple of them.
        match: a regular expression that ``re.search`` must find in ``str(exception)``.
    """
    caught = Raised()
    names = (expected.__name__ if isinstance(expected, type)
             else " or ".join(e.__name__ for e in expected))
    problem = ""
    try:
        yield caught
        problem = f"did not raise {names}"
    except Exception as e:  # pytest.skip and pytest.fail are no Exception: they go through
        caught.value = e
        if not isinstance(e, expected):
            problem = f"raised {type(e).__name__}: {e} (expected {names})"
        elif match is not None and not re.search(match, str(e)):
            problem = f"{names} {str(e)!r} does not match {match!r}"
    try:
        assert_all_ranks(comm, not problem, problem)
    except AssertionError as verdict:
        raise verdict from (caught.value if problem else None)
