"""LARS (You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks",
Algorithm 1): SGD with momentum whose step size is set per tensor by its norms."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from mpidl.autograd import Tensor
from mpidl.backend import get_array_module
from mpidl.optim.layerwise import LayerwiseOptimizer, TensorNorms, trust


class LARS(LayerwiseOptimizer):
    """LARS, per model tensor ``w`` with gradient ``g`` (the paper's Algorithm 1)::

        local_lr = eta * |w| / (|g| + weight_decay * |w|)    (biases and norms: 1)
        buf = momentum * buf + lr * local_lr * (g + weight_decay * w)
        w = w - buf

    (biases and normalisation parameters get no weight decay and a local rate of 1, as
    the paper's follow-ups and common implementations exclude them; a tensor whose
    ``|w|`` or denominator is 0 gets 1 too.) ``eta``, the trust coefficient, is the
    paper's 0.001; ``lr`` is the global rate of the schedule (the paper's gamma).

    The norms are of whole model tensors on every layout (:class:`TensorNorms`), reduced
    in one collective per step.

    Args:
        params: the parameters.
        lr: the global learning rate.
        momentum: the momentum factor.
        weight_decay: the L2 coefficient (the paper's beta), inside the local rate and
            the update.
        eta: the trust coefficient.
        max_trust: clip the local rate at this value (None: no clip).
        norms: where each model tensor is (default: each parameter whole).

    State: ``state.<i>.momentum_buffer``.
    """

    state_arrays = ("momentum_buffer",)

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.9,
                 weight_decay: float = 5e-4, eta: float = 1e-3,
                 max_trust: float | None = None, norms: TensorNorms | None = None) -> None:
        super().__init__(params, lr, norms)
        if momentum < 0 or weight_decay < 0 or eta <= 0:
            raise ValueError(f"LARS needs momentum >= 0, weight_decay >= 0 and eta > 0, "
                             f"got {momentum}, {weight_decay}, {eta}")
        if max_trust is not None and max_trust <= 0:
            raise ValueError(f"max_trust must be > 0 or None, got {max_trust}")
        self.momentum, self.weight_decay = float(momentum), float(weight_decay)
        self.eta, self.max_trust = float(eta), max_trust

    def _prepare(self, i: int, p: Tensor) -> Sequence[Any]:
        return p.data, p.grad

    def _ratios(self, norms: Any) -> Any:
        w, g = norms[0], norms[1]
        excluded = self.norms.on_device("excluded", get_array_module(norms))
        return trust(self.eta * w, g + self.weight_decay * w, excluded, self.max_trust)

    def _apply(self, i: int, p: Tensor, ratios: Any, lr: float) -> None:
        st = self.state[i]
        xp = get_array_module(p.data)
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = xp.zeros_like(p.data)
        buf, w, g = (a.reshape(-1) for a in (st["momentum_buffer"], p.data, p.grad))
        (d,) = self._temps(w, 1)
        for s in self.norms.segments[i]:
            a, b = s.start, s.stop
            step = d[a:b]
            if self.weight_decay and not self.norms.excluded[s.tensor]:
                xp.multiply(w[a:b], self.weight_decay, out=step)
                step += g[a:b]
            else:
                step[...] = g[a:b]
            step *= lr * ratios[s.tensor]
            buf[a:b] *= self.momentum
            buf[a:b] += step
            w[a:b] -= buf[a:b]


__all__ = ["LARS"]
