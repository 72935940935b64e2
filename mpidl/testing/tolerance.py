"""The one place that owns float tolerances, per dtype.

Tests never write their own ``rtol``/``atol``: they ask here, so a change of policy (or
a new dtype) is one edit. The values are for results that went through a few layers of
arithmetic and a reduction across ranks (a different summation order than one process).
"""
from __future__ import annotations

from typing import Any

import numpy

# dtype name -> (rtol, atol)
_TOLERANCES = {
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
    "float32": (1e-5, 1e-6),
    "float64": (1e-10, 1e-12),
}
# Integer arithmetic is exact.
_EXACT = (0.0, 0.0)


def tolerance(dtype: Any) -> tuple[float, float]:
    """``(rtol, atol)`` for comparing arrays of ``dtype`` (exact for integers)."""
    name = numpy.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name in _TOLERANCES:
        return _TOLERANCES[name]
    if numpy.issubdtype(numpy.dtype(name), numpy.integer) or name == "bool":
        return _EXACT
    raise ValueError(f"no tolerance defined for dtype {name!r}")


def allclose(actual: Any, desired: Any, dtype: Any = None, scale: float = 1.0) -> bool:
    """``numpy.allclose`` with this module's tolerances (times ``scale``), on host copies."""
    from mpidl.backend import as_numpy

    a, d = as_numpy(actual), as_numpy(desired)
    rtol, atol = tolerance(dtype if dtype is not None else a.dtype)
    return a.shape == d.shape and bool(numpy.allclose(a, d, rtol=rtol * scale, atol=atol * scale))
