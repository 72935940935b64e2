"""The model state a rank holds: bytes in parameters, gradients and optimizer state.

What ZeRO shards and data parallelism keeps whole, measured from the arrays themselves
(each underlying buffer counted once: a gradient bucket holding every ``.grad`` view is
one array), for the metrics and the end summary of a run.
"""
from __future__ import annotations

from typing import Any


def _buffer(a: Any) -> Any:
    base = getattr(a, "base", None)
    return a if base is None else base


def state_bytes(wrapper: Any, optimizer: Any) -> dict[str, int]:
    """``{"parameters", "gradients", "optimizer"}`` bytes held on this rank now.

    ``wrapper`` is a :class:`~mpidl.parallel.DataParallel` (full parameters; gradients
    in its buckets) or a :class:`~mpidl.parallel.ShardedDataParallel` (its own count).
    """
    if hasattr(wrapper, "state_bytes"):
        return wrapper.state_bytes(optimizer)
    seen: set[int] = set()

    def size(a: Any) -> int:
        if a is None:
            return 0
        b = _buffer(a)
        if id(b) in seen:
            return 0
        seen.add(id(b))
        return int(b.nbytes)

    params = sum(size(p.data) for p in wrapper.parameters())
    grads = sum(size(b.flat) for b in getattr(wrapper, "buckets", ())) + sum(
        size(p.grad) for p in wrapper.parameters())
    state = sum(int(v.nbytes) for v in optimizer.state_dict().values() if hasattr(v, "nbytes"))
    return {"parameters": params, "gradients": grads, "optimizer": state}
