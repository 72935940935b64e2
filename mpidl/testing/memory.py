"""Peak host memory of a piece of work, measured with :mod:`tracemalloc`.

NumPy reports its array allocations to tracemalloc, so the peak of traced memory while a
forward and backward pass runs is the memory its activations (and temporaries) need on
this rank: what the memory claims of tensor and sequence parallelism are measured with.
Device (CuPy) memory is not traced.
"""
from __future__ import annotations

import tracemalloc
from typing import Any, Callable


def peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()``; return its result and the peak of traced memory above the start.

    Not collective. Starts tracing for the call if it was not on (tracing slows Python
    allocations: measure in a separate run from timings).
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        if started:
            tracemalloc.stop()
    return out, peak - base


__all__ = ["peak_bytes"]
