"""16-bit floats computed in float32: the boundary where half precision is widened.

Mixed precision keeps activations in float16 or bfloat16 but does the arithmetic that
loses precision in float32 (Micikevicius et al. 2018; PyTorch autocast's fp32 list):
normalisation statistics, softmax and its sums, the loss, erf. In float16 a sum of
squares overflows past 65504 and ``1 + erf(x)`` cancels near -3; in bfloat16 (8 bits
of mantissa) a sum of 10,000 values stops growing at 256, and NumPy has no bfloat16
``einsum`` at all. :func:`widened` makes a :class:`~mpidl.autograd.Function` do that:
its 16-bit float inputs are widened to float32, forward and backward run as they do in
float32, and the outputs and input gradients are rounded back once. The inputs it keeps
for backward stay 16-bit (widened again in backward, exactly); what it derives from
them (attention probabilities, GELU's tanh, the loss's softmax) is kept in float32.
"""
from __future__ import annotations

from typing import Any

from mpidl.backend import compute_dtype, is_half


def _is_half_array(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "astype") and is_half(x.dtype)


def _widen(x: Any) -> Any:
    return x.astype(compute_dtype(x.dtype)) if _is_half_array(x) else x


def widened(cls: type, keep_float32: tuple[int, ...] = ()) -> type:
    """Make Function class ``cls`` compute 16-bit float inputs in float32.

    Outputs come back in the half dtype of the first half input, except the outputs
    whose positions are in ``keep_float32`` (a loss stays float32, as Megatron keeps
    it). Gradients come back in each input's own dtype. Other dtypes pass untouched.
    """
    forward, backward = cls.forward, cls.backward

    def half_forward(self: Any, *xs: Any) -> Any:
        halves = [x.dtype for x in xs if _is_half_array(x)]
        self._half_dtypes = None
        if not halves:
            return forward(self, *xs)
        self._half_dtypes = [x.dtype if _is_half_array(x) else None for x in xs]
        wide = [_widen(x) for x in xs]
        ys = forward(self, *wide)
        _keep_inputs_half(self, wide, xs)
        many = isinstance(ys, tuple)
        out = tuple(y if (i in keep_float32 or y is None) else y.astype(halves[0])
                    for i, y in enumerate(ys if many else (ys,)))
        return out if many else out[0]

    def half_backward(self: Any, *gys: Any) -> Any:
        if self._half_dtypes is None:
            return backward(self, *gys)
        for name in self._kept_half:
            setattr(self, name, _widen(getattr(self, name)))
        gxs = backward(self, *[_widen(g) for g in gys])
        many = isinstance(gxs, tuple)
        gxs = gxs if many else (gxs,)
        out = tuple(g if (g is None or dt is None) else g.astype(dt)
                    for g, dt in zip(gxs, self._half_dtypes))
        return out if many else out[0]

    cls.forward, cls.backward = half_forward, half_backward
    return cls


def _keep_inputs_half(f: Any, wide: list, xs: tuple) -> None:
    """Swap the widened inputs ``f`` saved for backward (or whole views of them) for
    the half originals, recorded in ``f._kept_half``: widening is exact, so backward
    widens them again to the very same values, and the graph holds 2 bytes per element
    instead of 4 (the gpt's layer norms, GELU and attention inputs)."""
    originals = {id(w): x for w, x in zip(wide, xs) if w is not x}
    f._kept_half = []
    for name, value in list(vars(f).items()):
        x = originals.get(id(value))
        if x is None:  # a whole, contiguous view of a widened input (a flattened one)
            base = getattr(value, "base", None)
            x = originals.get(id(base)) if base is not None else None
            if (x is None or value.size != x.size or not x.flags.c_contiguous
                    or not value.flags.c_contiguous):
                continue
            x = x.reshape(value.shape)
        setattr(f, name, x)
        f._kept_half.append(name)


__all__ = ["widened"]
