"""The model state a rank holds: bytes in parameters, gradients and optimizer state.

What ZeRO shards and data parallelism keeps whole, measured from the arrays themselves
(each underlying buffer counted once: a gradient bucket holding every ``.grad`` view is
one array), for the metrics and the end summary of a run.
"""
from __future__ import annotations

from typing import Any


def state_bytes(wrapper: Any, optimizer: Any) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer"}`` bytes held on this rank now: what
    the run's :class:`~mpidl.parallel.wrapper.Wrapper` counts."""
    return wrapper.state_bytes(optimizer)
