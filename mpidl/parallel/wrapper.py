"""The one interface of a wrapped model: what the trainer asks of every wrapper.

:class:`~mpidl.parallel.DataParallel` and :class:`~mpidl.parallel.ShardedDataParallel`
(over a plain world or over a grid's replicas, around a :class:`~mpidl.parallel.ParallelGPT`)
implement :class:`Wrapper`; the trainer, the planner and the objectives call these
methods and read these attributes without probing for them (no ``hasattr``).
:class:`HeldBytes` is the one rule for counting the memory a rank holds.
"""
from __future__ import annotations

from typing import Any, ContextManager, Protocol, runtime_checkable


@runtime_checkable
class Wrapper(Protocol):
    """A model replicated (and maybe sharded) over a group of ranks.

    Attributes:
        module: the wrapped model (its forward hooks and parameters are the wrapper's).
        comm: the group the gradients are reduced over.
        comm_wait_seconds: how long the last backward waited for communication.
        comm_wait_start: that wait's ``time.perf_counter()`` start (for timelines).
    """

    module: Any
    comm: Any
    comm_wait_seconds: float
    comm_wait_start: float

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward of the model, after :meth:`before_forward`. Collective."""

    def before_forward(self) -> None:
        """What a forward needs first (updated parameters, rank 0's drifting buffers),
        for a caller that runs another method of the model than ``forward``. Collective."""

    def parameters(self) -> list:
        """What the optimizer updates (the model's parameters, or this rank's shards)."""

    def backward(self, loss: Any, global_count: int | None = None,
                 scale: float = 1.0) -> None:
        """Backward of this rank's summed ``loss``; the gradients become the mean over
        ``global_count`` samples of every rank (see DataParallel). Collective."""

    def no_sync(self) -> ContextManager[None]:
        """Accumulate the next backwards without the full exchange (micro-batches)."""

    def clip_grad_norm_(self, max_norm: float) -> Any:
        """Clip the averaged gradient to a global 2-norm; returns the norm before."""

    def tensor_norms(self, tensor: Any = None) -> Any:
        """Where the model's tensors are among :meth:`parameters`
        (:class:`~mpidl.optim.TensorNorms`, for LARS and LAMB); ``tensor``: the
        tensor-parallel group its split parameters span."""

    def state_bytes(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank holds now: ``{"parameters", "gradients", "optimizer"}``."""

    def close(self) -> None:
        """Detach from the model and release communication resources. Collective."""


class HeldBytes:
    """Bytes of arrays, each underlying buffer counted once: a bucket that every
    ``.grad`` views, or a flat unit that every parameter views, is one array."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def __call__(self, *arrays: Any) -> int:
        total = 0
        for a in arrays:
            if a is None:
                continue
            base = getattr(a, "base", None)
            buffer = a if base is None else base
            if id(buffer) not in self._seen:
                self._seen.add(id(buffer))
                total += int(buffer.nbytes)
        return total

    def optimizer(self, optimizer: Any) -> int:
        """The optimizer's state arrays (none before its first step)."""
        if optimizer is None:
            return 0
        return self(*(v for v in optimizer.state_dict().values() if hasattr(v, "nbytes")))


__all__ = ["Wrapper", "HeldBytes"]
