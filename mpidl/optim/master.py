"""fp32 master weights for half-precision parameters, around any optimizer.

Mixed precision (Micikevicius et al. 2018, "Mixed Precision Training") runs forward and
backward on float16 or bfloat16 parameters but keeps an fp32 *master* copy that the
optimizer updates: an update smaller than half an ulp of the parameter (bfloat16 has
8 bits: lr 1e-3 times a unit Adam step on a weight of 1 is below 2**-8) would round
away in the half copy every step, but accumulates in the master. After each step the
half parameters are the master rounded once::

    opt = MasterWeights(AdamW(wrapper.parameters(), lr=1e-3))   # half params inside
    wrapper.backward(loss, global_count=n, scale=scaler.scale)   # fp32 gradients
    opt.step()                                                   # fp32 update, rounded
    opt.zero_grad()

The inner optimizer (SGD, Adam, AdamW, LARS, LAMB: any :class:`Optimizer`) is rebuilt
over fp32 Parameters holding the masters; its state is fp32 because its parameters
are. The master of parameter ``i`` is optimizer state ``state.<i>.master``, so it is
checkpointed, sharded under ZeRO (the optimizer sees this rank's shards: the master
shard lives beside the moments) and counted by the wrappers' ``state_bytes`` like any
other state array. Gradients may be half or fp32 (the wrappers' fp32 buckets,
:mod:`mpidl.parallel.buckets`); half ones are widened for the update.

Bytes per parameter with Adam, as the wrappers' ``state_bytes`` count them (benchmarks
and tests/unit/test_master_weights.py): fp32 4 + 4 + 8 = 16; half parameters with fp32
gradient buckets 2 + 4 + 12 = 18 (Megatron's bf16 row); ZeRO divides the 12 (and at
stage 2 the 4) by the ranks.
"""
from __future__ import annotations

from typing import Any

import numpy

from mpidl.backend import get_array_module, is_half, to_device
from mpidl.nn.module import Parameter
from mpidl.optim.optimizer import Optimizer

MASTER = "master"  # the state array holding a parameter's fp32 master copy


class MasterWeights:
    """``optimizer`` updating fp32 masters of its (half) parameters; same interface.

    Args:
        optimizer: a fresh optimizer (no step taken) over the half parameters, e.g.
            ``AdamW(model.parameters())`` or over a wrapper's ZeRO shards. It is
            re-pointed at fp32 Parameters, one per parameter, from here on.

    Attributes:
        params: the half parameters (what the wrappers and checkpoints index by).
        inner: the wrapped optimizer, over :attr:`masters`.
        masters: the fp32 Parameters the inner optimizer updates.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        if optimizer.step_count or any(optimizer.state):
            raise ValueError(f"MasterWeights({type(optimizer).__name__}): the optimizer "
                             "has taken steps already; wrap it when it is built")
        self.inner = optimizer
        self.params = list(optimizer.params)
        for i, p in enumerate(self.params):
            if not (is_half(p.data.dtype) or p.data.dtype == numpy.float32):
                raise TypeError(f"MasterWeights: parameter {i} is {p.data.dtype}; fp32 "
                                "masters are for float16, bfloat16 (or float32) parameters")
        self.masters = [Parameter(p.data.astype(numpy.float32), name=f"master.{i}")
                        for i, p in enumerate(self.params)]
        optimizer.params = self.masters
        for st, m in zip(optimizer.state, self.masters):
            st[MASTER] = m.data
        self.state_arrays = (*optimizer.state_arrays, MASTER)
        self.state_ints = optimizer.state_ints

    # -- what the trainer and checkpoints read and set -------------------------------------
    @property
    def lr(self) -> float:
        return self.inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.inner.lr = value

    @property
    def step_count(self) -> int:
        return self.inner.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.inner.step_count = value

    @property
    def state(self) -> list[dict[str, Any]]:
        """The inner optimizer's per-parameter state, each with its ``master``."""
        return self.inner.state

    @state.setter
    def state(self, value: list[dict[str, Any]]) -> None:
        self.inner.state = value  # a checkpoint load refills it, masters included

    def state_dtype(self, param: Any) -> Any:
        """float32: masters and the state of an optimizer over them."""
        return numpy.float32

    # -- the step ---------------------------------------------------------------------------
    def _master(self, i: int) -> Any:
        """Parameter ``i``'s master array (from the half values where a load left none)."""
        st, p = self.inner.state[i], self.params[i]
        if MASTER not in st:
            st[MASTER] = p.data.astype(numpy.float32)
        return st[MASTER]

    def step(self) -> None:
        """The inner optimizer's step on the masters, then each updated half parameter
        set to its master rounded once. Collective where the inner step is (LARS, LAMB)."""
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            m.data = self._master(i)
            g = p.grad
            m.grad = None if g is None else (g if g.dtype == numpy.float32
                                             else g.astype(numpy.float32))
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            if p.grad is not None:
                p.data[...] = m.data  # in place: buckets and ZeRO shards view p.data
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the half parameters' gradients (as :meth:`Optimizer.zero_grad`)."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.fill(0)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's flat state, with ``state.<i>.master`` for every i."""
        for i in range(len(self.params)):
            self._master(i)
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` output; a state without masters (saved by a
        plain optimizer) takes them from the half parameters."""
        masters = {k: v for k, v in state.items() if k.endswith("." + MASTER)}
        self.inner.load_state_dict({k: v for k, v in state.items() if k not in masters})
        for key, value in masters.items():
            i = int(key.split(".")[1])
            p = self.params[i]
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"MasterWeights.load_state_dict: {key} has shape "
                                 f"{tuple(value.shape)}, parameter {i} {tuple(p.shape)}")
            xp = get_array_module(p.data)
            self.inner.state[i][MASTER] = to_device(value, xp).astype(numpy.float32)
        for i in range(len(self.params)):
            self._master(i)

    def __repr__(self) -> str:
        return f"MasterWeights({self.inner!r})"


__all__ = ["MasterWeights", "MASTER"]
