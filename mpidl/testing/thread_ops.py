"""How thread ranks reduce: MPI's named ops and mpidl's 16-bit wire sums, folded over
the ranks' parts in rank order into a fresh array.

MPI may sum in another order (a float sum can differ from MPI's in the last bits, as two
MPI libraries do); a fold here is the same on every rank and every run.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy

from mpidl.backend import get_array_module
from mpidl.comm import base


def _fold(combine: Callable[[Any, Any], None]) -> Callable[[list], Any]:
    """A reduction over the ranks' parts in rank order, into a fresh array."""

    def fold(parts: list) -> Any:
        acc = parts[0].copy()
        # inf - inf and overflow are the IEEE results MPI's own sum gives, silently.
        with numpy.errstate(over="ignore", invalid="ignore"):
            for p in parts[1:]:
                combine(acc, p)
        return acc

    return fold


def _ufunc(name: str) -> Callable[[Any, Any], None]:
    def combine(acc: Any, p: Any) -> None:
        getattr(get_array_module(acc), name)(acc, p, out=acc)

    return combine


FOLDS = {"sum": _fold(_ufunc("add")), "max": _fold(_ufunc("maximum")),
          "min": _fold(_ufunc("minimum")), "prod": _fold(_ufunc("multiply"))}


def _add_float16_bits(acc: Any, p: Any) -> None:
    xp = get_array_module(acc)
    halves = acc.view(xp.float16)  # a view: the sum lands in acc
    xp.add(halves, p.view(xp.float16), out=halves)


def _add_bfloat16_bits(acc: Any, p: Any) -> None:
    from mpidl.parallel.compression import bfloat16_to_float32, float32_to_bfloat16

    xp = get_array_module(acc)
    bits = acc.view(xp.uint16)  # a view: the rounded sum lands in acc
    total = bfloat16_to_float32(bits) + bfloat16_to_float32(p.view(xp.uint16))
    float32_to_bfloat16(total, out=bits)


def wire_sum(x: Any, op: Any, what: str) -> tuple[str, Callable[[list], Any]]:
    """The fold of one of mpidl's user-defined MPI ops, found by identity.

    The ops exist only once mpi4py made them (or a test stood in for them), so asking
    :func:`~mpidl.parallel.compression.wire_sum_op` for the same op returns that very
    object without importing MPI anew.
    """
    from mpidl.parallel import compression

    for wire_dtype, combine in (("float16", _add_float16_bits),
                                ("bfloat16", _add_bfloat16_bits)):
        try:
            known = compression.wire_sum_op(wire_dtype)
        except ImportError:  # no mpi4py: this op cannot be one of them
            continue
        if op is known:
            if x.dtype.itemsize != 2:
                raise TypeError(f"{what} with the {wire_dtype} wire sum of a {x.dtype} "
                                "array: the op sums 16-bit buffers; pass the wire buffer "
                                "(mpidl.parallel.compression.compress)")
            return f"{wire_dtype} wire sum", _fold(combine)
    raise TypeError(f"{what} with op={op!r}: ThreadCommunicator knows the named ops "
                    f"{', '.join(base.OPS)} and mpidl's 16-bit wire sums "
                    "(mpidl.parallel.compression.wire_sum_op) only")


__all__ = ["FOLDS", "wire_sum"]
