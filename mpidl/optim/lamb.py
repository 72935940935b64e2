"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in
76 minutes", Algorithm 2): Adam's direction, rescaled per tensor to the tensor's norm."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module
from mpidl.optim.layerwise import LayerwiseOptimizer, TensorNorms, trust


class LAMB(LayerwiseOptimizer):
    """LAMB, per model tensor ``x`` (the paper's Algorithm 2, with bias correction)::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        r = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)
        u = r + weight_decay * x                  (biases and norms: u = r)
        x = x - lr * min(|x| / |u|, max_trust) * u    (1 where |x| or |u| is 0;
                                                      biases and norms: 1)

    The trust ratio ``|x| / |u|`` makes the step of every tensor ``lr`` times its own
    norm, whatever its gradient's scale: the paper's cure for layers whose gradients
    and weights differ in scale by orders of magnitude at large batch. ``max_trust``
    clips the ratio (the paper's phi; 10 as common implementations bound it).

    The norms are of whole model tensors on every layout (:class:`TensorNorms`: ZeRO
    shards, tensor-parallel splits), reduced in one collective per step. A float16
    parameter keeps float32 moments and is updated in float32, rounded once (as
    :class:`~mpidl.optim.Adam`).

    Args:
        params: the parameters (``model.parameters()`` or a wrapper's).
        lr: learning rate.
        betas, eps: as Adam's; eps 1e-6 as the paper's experiments.
        weight_decay: decoupled decay added to the direction (the paper's lambda).
        max_trust: the largest trust ratio, or None for no clip.
        norms: where each model tensor is (default: each parameter whole).

    State: ``state.<i>.exp_avg``, ``state.<i>.exp_avg_sq`` (arrays), ``state.<i>.step``.
    """

    state_arrays = ("exp_avg", "exp_avg_sq")
    state_ints = ("step",)

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, max_trust: float | None = 10.0,
                 norms: TensorNorms | None = None) -> None:
        super().__init__(params, lr, norms)
        b1, b2 = betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        if max_trust is not None and max_trust <= 0:
            raise ValueError(f"max_trust must be > 0 or None, got {max_trust}")
        self.betas, self.eps = (float(b1), float(b2)), float(eps)
        self.weight_decay, self.max_trust = float(weight_decay), max_trust

    def state_dtype(self, param: Any) -> Any:
        """float32 for a float16 parameter (as Adam), else its dtype."""
        return numpy.float32 if param.dtype == numpy.float16 else param.dtype

    def _prepare(self, i: int, p: Tensor) -> Sequence[Any]:
        st = self.state[i]
        xp = get_array_module(p.data)
        if "exp_avg" not in st:
            st["exp_avg"] = xp.zeros(p.data.shape, dtype=self.state_dtype(p.data))
            st["exp_avg_sq"] = xp.zeros(p.data.shape, dtype=self.state_dtype(p.data))
            st["step"] = 0
        st["step"] += 1
        m, v = st["exp_avg"], st["exp_avg_sq"]
        b1, b2 = self.betas
        g = p.grad.astype(m.dtype, copy=False)
        m *= b1
        m += (1.0 - b1) * g
        v *= b2
        v += (1.0 - b2) * (g * g)
        x = p.data.astype(m.dtype, copy=False)
        return x, self._direction(i, x)

    def _direction(self, i: int, x: Any) -> Any:
        """``u`` of parameter ``i`` (its current parameters ``x``) into a scratch array:
        the same arithmetic in both passes, so pass 2 scales exactly what pass 1 summed."""
        st = self.state[i]
        m, v, t = st["exp_avg"], st["exp_avg_sq"], st["step"]
        b1, b2 = self.betas
        xp = get_array_module(m)
        (u,) = self._temps(m.reshape(-1), 1)
        xp.divide(v.reshape(-1), 1.0 - b2 ** t, out=u)
        xp.sqrt(u, out=u)
        u += self.eps
        xp.divide(m.reshape(-1) / (1.0 - b1 ** t), u, out=u)
        if self.weight_decay:
            flat = x.reshape(-1)
            for s in self.norms.segments[i]:
                if not self.norms.excluded[s.tensor]:
                    u[s.start:s.stop] += self.weight_decay * flat[s.start:s.stop]
        return u

    def _ratios(self, norms: Any) -> Any:
        excluded = self.norms.on_device("excluded", get_array_module(norms))
        return trust(norms[0], norms[1], excluded, self.max_trust)

    def _apply(self, i: int, p: Tensor, ratios: Any, lr: float) -> None:
        x = p.data.astype(self.state[i]["exp_avg"].dtype, copy=False)
        u = self._direction(i, x)
        flat = x.reshape(-1)
        for s in self.norms.segments[i]:
            flat[s.start:s.stop] -= (lr * ratios[s.tensor]) * u[s.start:s.stop]
        if x is not p.data:
            p.data[...] = x  # a float16 parameter, rounded once


__all__ = ["LAMB"]
