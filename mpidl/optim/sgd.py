"""Stochastic gradient descent with momentum, Nesterov momentum and L2 weight decay."""
from __future__ import annotations

from typing import Any, Iterable

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module
from mpidl.optim.optimizer import Optimizer


class SGD(Optimizer):
    """SGD, with PyTorch's update (``torch.optim.SGD``, dampening 0)::

        g = grad + weight_decay * param
        buf = g                      (first step)
        buf = momentum * buf + g     (later steps)
        g = g + momentum * buf       (nesterov)   or   g = buf   (momentum)
        param = param - lr * g

    Args:
        params: the parameters, e.g. ``model.parameters()``.
        lr: learning rate.
        momentum: momentum factor (0 disables the buffer).
        nesterov: Nesterov momentum (Sutskever et al. 2013); needs ``momentum > 0``.
        weight_decay: L2 penalty coefficient, added to the gradient.

    State: ``state.<i>.momentum_buffer`` when ``momentum > 0``.
    """

    state_arrays = ("momentum_buffer",)

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        if momentum < 0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if nesterov and momentum <= 0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.momentum = float(momentum)
        self.nesterov = nesterov
        self.weight_decay = float(weight_decay)

    def _begin(self, i: int, param: Any, lr: float) -> None:
        if self.momentum and "momentum_buffer" not in self.state[i]:
            # Zeros, not a copy of the first gradient as PyTorch starts: the first update
            # momentum * 0 + g is exactly g, so the results are the same.
            self.state[i]["momentum_buffer"] = get_array_module(param).zeros_like(param)

    def _update(self, param: Any, grad: Any, *state: Any, lr: float) -> None:
        xp = get_array_module(param)
        (d,) = self._temps(param, 1)
        g = grad
        if self.weight_decay:
            xp.multiply(param, self.weight_decay, out=d)
            d += grad
            g = d
        if self.momentum:
            (buf,) = state
            buf *= self.momentum
            buf += g
            if self.nesterov:
                if g is d:
                    d += self.momentum * buf
                else:
                    xp.multiply(buf, self.momentum, out=d)
                    d += g
                g = d
            else:
                g = buf
        # Scale into the scratch array and add: no allocation per step, and the
        # gradient (maybe a bucket view) is left untouched.
        xp.multiply(g, -lr, out=d)
        param += d
