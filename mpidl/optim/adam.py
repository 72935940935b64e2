"""Adam (Kingma & Ba 2015) and AdamW (Loshchilov & Hutter 2019, decoupled weight decay)."""
from __future__ import annotations

import math
from typing import Any, Iterable

import numpy

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module
from mpidl.optim.optimizer import Optimizer


class Adam(Optimizer):
    """Adam, with PyTorch's update (``torch.optim.Adam``, amsgrad off)::

        g = grad + weight_decay * param              (Adam: L2 in the gradient)
        param = param * (1 - lr * weight_decay)      (AdamW instead: decoupled)
        m = m + (1 - beta1) * (g - m)                (torch's lerp form)
        v = beta2 * v + (1 - beta2) * g * g
        t = t + 1
        param = param - (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    The step counter and bias corrections are Python numbers, so a step never reads
    a device value back to the host.

    A float16 parameter keeps its moments in float32 and is updated in float32, then
    rounded to float16 once per step: in float16, ``eps=1e-8`` rounds to 0 and an
    element whose moments are still 0 computes 0/0 = NaN (and small squared gradients
    underflow ``v`` to 0), so the first step turned a gradient ``[0, 1e-3, 0, 1]`` into
    parameters ``[nan, -inf, nan, 0.999]``.

    Args:
        params: the parameters, e.g. ``model.parameters()``.
        lr: learning rate.
        betas: decay rates of the first and second moment estimates.
        eps: added to the denominator for numerical stability.
        weight_decay: L2 penalty coefficient.

    State: ``state.<i>.exp_avg``, ``state.<i>.exp_avg_sq`` (arrays), ``state.<i>.step`` (int).
    """

    state_arrays = ("exp_avg", "exp_avg_sq")
    state_ints = ("step",)
    decoupled = False

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        self.betas = (float(b1), float(b2))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

    def state_dtype(self, param: Any) -> Any:
        """float32 for a float16 parameter (see the class docstring), else its dtype."""
        return numpy.float32 if param.dtype == numpy.float16 else param.dtype

    def _begin(self, i: int, param: Any, lr: float) -> None:
        st = self.state[i]
        if "exp_avg" not in st:
            xp = get_array_module(param)
            st["exp_avg"] = xp.zeros(param.shape, dtype=self.state_dtype(param))
            st["exp_avg_sq"] = xp.zeros(param.shape, dtype=self.state_dtype(param))
            st["step"] = 0
        st["step"] += 1
        t = st["step"]
        b1, b2 = self.betas
        # Host numbers, the same for every block of this parameter.
        self._step_size = lr / (1.0 - b1 ** t)
        self._bias_correction2_sqrt = math.sqrt(1.0 - b2 ** t)

    def _update(self, param: Any, grad: Any, *state: Any, lr: float) -> None:
        m, v = state
        if param.dtype == m.dtype:
            d, e = self._temps(param, 2)  # d: the (decayed) gradient, e: intermediate terms
            self._adam(param, grad, m, v, d, e, lr)
            return
        # A float16 parameter with float32 moments: the whole update in float32.
        p, g, d, e = self._temps(m, 4)
        p[...] = param
        g[...] = grad
        self._adam(p, g, m, v, d, e, lr)
        param[...] = p  # rounded to float16 once

    def _adam(self, param: Any, grad: Any, m: Any, v: Any, d: Any, e: Any, lr: float) -> None:
        """The update in ``param``'s dtype; ``d``, ``e``: scratch arrays like it."""
        xp = get_array_module(param)
        b1, b2 = self.betas
        g = grad
        if self.weight_decay:
            if self.decoupled:
                param *= 1.0 - lr * self.weight_decay
            else:
                xp.multiply(param, self.weight_decay, out=d)
                d += grad
                g = d
        xp.subtract(g, m, out=e)
        e *= 1.0 - b1
        m += e
        v *= b2
        xp.multiply(g, 1.0 - b2, out=e)
        e *= g
        v += e
        xp.sqrt(v, out=e)
        e /= self._bias_correction2_sqrt
        e += self.eps
        xp.multiply(m, -self._step_size, out=d)
        d /= e
        param += d


class AdamW(Adam):
    """Adam with decoupled weight decay (``torch.optim.AdamW``): the parameter shrinks by
    ``lr * weight_decay`` before the Adam step instead of the decay entering the gradient.

    Args: as :class:`Adam`, with ``weight_decay`` defaulting to 0.01.
    """

    decoupled = True

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
