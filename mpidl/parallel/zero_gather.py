"""ZeRO's parameter gathers: a unit's full parameters from every rank's block.

:class:`~mpidl.parallel.zero.ShardedDataParallel` keeps one block of each unit per rank
(:mod:`mpidl.parallel.units`); a forward needs the whole unit. :class:`Gathers` brings
it back:

- stages 1 and 2 keep each unit's full buffer and allgather the updated blocks into it
  once after an optimizer step (:meth:`Gathers.refresh`, run by the next forward);
- stage 3 keeps no full parameters between uses: a unit is allgathered just before its
  module's forward and released after it, gathered again just before its backward (an
  identity Function on the module's output runs the gather when backward reaches it),
  and the next unit's gather (forward order on the way in, reversed on the way back) is
  started early, non-blocking, so that it overlaps the compute of this one. The model's
  own unit (tied parameters, GPT's embedding and output projection) stays gathered for
  the whole forward and backward.

Collective contract (stage 3): every rank's forward and backward reach the units in the
same order (FSDP's static graph), so that every rank issues the same allgathers in the
same order. :attr:`Gathers.peak_bytes` measures what stage 3 holds on top of the shards.
"""
from __future__ import annotations

from typing import Any

from mpidl.autograd import Function, Tensor
from mpidl.comm.base import Communicator
from mpidl.nn.module import Module
from mpidl.parallel.units import Unit


class _GatherForBackward(Function):
    """Identity in forward; in backward, gathers the unit's parameters first (stage 3)."""

    def forward(self, x):
        return x

    def backward(self, gy):
        self.gathers.before_backward(self.unit)
        return gy


class Gathers:
    """The allgathers of a sharded model's units, and stage 3's schedule of them.

    Args:
        comm: the replicas' communicator (stage 3's prefetches are its ``iallgather``).
        transport: the wrapper's transport (its blocking ``allgather``).
        units: the wrapper's units, in their index order (the same on every rank).
        model: the wrapped model; its own unit stays gathered through backward.

    Attributes:
        order: the units in forward order, as stage 3's hooks have seen them.
        peak_bytes: the most full parameters, full gradients and prefetches held at
            once (stage 3's transient memory on top of the shards).
    """

    def __init__(self, comm: Communicator, transport: Any, units: list[Unit],
                 model: Module) -> None:
        self.comm, self.transport, self.units, self.model = comm, transport, units, model
        self.order: list[Unit] = []
        self.peak_bytes = 0

    def gather(self, u: Unit) -> None:
        """Point ``u``'s members at its full parameters, finishing its prefetch if one
        is in flight, else allgathering them now. Collective."""
        if u.request is not None:
            flat = u.request.wait().reshape(-1)
            u.request = None
        else:
            flat = self.transport.allgather(u.shard.data, u.flat if u.flat is not None
                                            else u.new_flat())
        u.point_params_at(flat)
        self.track()

    def refresh(self) -> None:
        """Allgather every unit's updated block into its full buffer (stages 1-2, after
        an optimizer step). Collective."""
        for u in self.units:
            self.transport.allgather(u.shard.data, u.flat)

    def track(self) -> None:
        """Update :attr:`peak_bytes` with what the units hold now."""
        held = sum((0 if u.flat is None else u.flat.nbytes)
                   + (0 if u.grad_flat is None else u.grad_flat.nbytes)
                   + (0 if u.request is None else u.padded * u.flat_itemsize)
                   for u in self.units)
        self.peak_bytes = max(self.peak_bytes, held)

    def _start(self, u: Unit) -> None:
        """Start the unit's allgather without waiting for it (the prefetch)."""
        if u.request is None and u.flat is None:
            u.request = self.comm.iallgather(u.shard.data)
            self.track()

    def _next(self, u: Unit, step: int) -> Unit | None:
        i = self.order.index(u) + step if u in self.order else -1
        return self.order[i] if 0 <= i < len(self.order) else None

    # -- stage 3 ------------------------------------------------------------------------------
    def install_hooks(self) -> list:
        """Stage 3: gather each unit around its module's forward. Returns the handles."""
        handles = []
        for u in self.units:
            handles += [u.module.register_forward_pre_hook(self._pre_forward(u)),
                        u.module.register_forward_hook(self._post_forward(u))]
        return handles

    def _pre_forward(self, u: Unit) -> Any:
        def hook(module: Module, args: tuple) -> None:
            if u not in self.order:
                self.order.append(u)
            self.gather(u)
            nxt = self._next(u, +1)
            if nxt is not None and nxt is not self.units[0]:
                self._start(nxt)
        return hook

    def _post_forward(self, u: Unit) -> Any:
        def hook(module: Module, args: tuple, out: Any) -> Any:
            if u.module is not self.model:
                u.release_params()
            if not isinstance(out, Tensor) or not out.requires_grad:
                return None
            return _GatherForBackward.apply(out, gathers=self, unit=u)
        return hook

    def before_backward(self, u: Unit) -> None:
        """Backward has reached ``u``'s module: its parameters and a full gradient
        buffer, and the previous unit's gather started."""
        if u.flat is None:
            self.gather(u)
        if u.grad_flat is None:
            u.attach_grads(u.new_grad_flat())
            self.track()
        prev = self._next(u, -1)
        if prev is not None and prev.flat is None:
            self._start(prev)


__all__ = ["Gathers"]
