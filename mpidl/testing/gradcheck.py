"""Gradient checks by central finite differences in float64.

    from mpidl.testing.gradcheck import gradcheck
    gradcheck(lambda x, w: F.matmul(x, w), [x_array, w_array])

:func:`gradcheck` compares the gradients that ``backward`` computes with
:func:`numerical_grad`'s ``(f(x + eps) - f(x - eps)) / 2 eps`` on every element of
every floating-point input, for a random upstream gradient (so a backward that only
works for ``ones`` is caught). Inputs are copied to float64 first, on their own array
module (NumPy or CuPy); integer and boolean inputs (labels, ids, masks) and
non-array arguments are passed through as constants.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy

from mpidl.autograd import Tensor, no_grad
from mpidl.backend import as_numpy, get_array_module


def _is_float(x: Any) -> bool:
    data = x.data if isinstance(x, Tensor) else x
    dtype = getattr(data, "dtype", None)
    return dtype is not None and getattr(data, "ndim", None) is not None and dtype.kind == "f"


def _prepare(inputs: Sequence[Any], wrt: Sequence[int] | None) -> tuple[list, list[int]]:
    """float64 copies of the floating inputs; the indices of those to differentiate."""
    arrays: list = []
    diff: list[int] = []
    for i, x in enumerate(inputs):
        if _is_float(x):
            data = x.data if isinstance(x, Tensor) else x
            arrays.append(data.astype(numpy.float64, copy=True))
            if wrt is None or i in wrt:
                diff.append(i)
        else:
            arrays.append(x)
    return arrays, diff


def _outputs(y: Any) -> tuple:
    return y if isinstance(y, (tuple, list)) else (y,)


def _upstream(outputs: tuple, seed: int) -> list:
    rng = numpy.random.default_rng(seed)
    grads = []
    for y in outputs:
        xp = get_array_module(y)
        g = rng.standard_normal(y.shape)
        grads.append(xp.asarray(g, dtype=y.dtype) if xp is not numpy else g.astype(y.dtype))
    return grads


def _objective(fn: Callable, arrays: list, grads: list) -> float:
    """``sum_k <fn(*arrays)[k], grads[k]>`` as a Python float."""
    with no_grad():
        outs = _outputs(fn(*[Tensor(a) if _is_float(a) else a for a in arrays]))
    total = 0.0
    for y, g in zip(outs, grads):
        data = y.data if isinstance(y, Tensor) else y
        total += float((data * g).sum())
    return total


def numerical_grad(
    fn: Callable,
    inputs: Sequence[Any],
    eps: float = 1e-6,
    grad_outputs: Sequence[Any] | None = None,
    wrt: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[int, numpy.ndarray]:
    """Central-difference gradients of ``<fn(*inputs), grad_outputs>`` in float64.

    Args:
        fn: maps the inputs (floating ones arrive as float64 Tensors) to a Tensor or a
            tuple of Tensors.
        inputs: arrays, Tensors, or constants.
        eps: the finite-difference step.
        grad_outputs: the upstream gradient per output; random normal (from ``seed``)
            when None.
        wrt: indices of the inputs to differentiate; all floating ones when None.
        seed: seed of the random upstream gradient.

    Returns:
        ``{input index: gradient as a NumPy float64 array}``.
    """
    arrays, diff = _prepare(inputs, wrt)
    if grad_outputs is None:
        with no_grad():
            outs = _outputs(fn(*[Tensor(a) if _is_float(a) else a for a in arrays]))
        grad_outputs = _upstream(tuple(o.data for o in outs), seed)
    grads: dict[int, numpy.ndarray] = {}
    for i in diff:
        x = arrays[i]
        g = numpy.zeros(x.shape)
        # Element by element through x's own indices: x may be strided (a transposed
        # input keeps its layout), where reshape(-1) would perturb a copy.
        for j in numpy.ndindex(*x.shape):
            orig = float(x[j])
            x[j] = orig + eps
            plus = _objective(fn, arrays, grad_outputs)
            x[j] = orig - eps
            minus = _objective(fn, arrays, grad_outputs)
            x[j] = orig
            g[j] = (plus - minus) / (2 * eps)
        grads[i] = g
    return grads


def gradcheck(
    fn: Callable,
    inputs: Sequence[Any],
    eps: float = 1e-6,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    wrt: Sequence[int] | None = None,
    seed: int = 0,
) -> bool:
    """Check ``fn``'s backward against central finite differences, in float64.

    Args:
        fn: maps the inputs to a Tensor or a tuple of Tensors, using mpidl functions.
        inputs: arrays, Tensors, or constants (ints, bool masks, None, labels).
        eps: finite-difference step.
        rtol, atol: an element passes when ``|analytic - numeric| <= atol + rtol *
            |numeric|``.
        wrt: indices of the inputs to check; all floating ones when None.
        seed: seed of the random upstream gradient.

    Returns:
        True when every element passes.

    Raises:
        AssertionError: naming the input, the worst element, both values and the
            tolerance.
    """
    arrays, diff = _prepare(inputs, wrt)
    if not diff:
        raise ValueError("gradcheck: no floating-point input to differentiate")
    tensors = [
        Tensor(a, requires_grad=(i in diff)) if _is_float(a) else a
        for i, a in enumerate(arrays)
    ]
    outs = _outputs(fn(*tensors))
    upstream = _upstream(tuple(o.data for o in outs), seed)
    for y, g in zip(outs, upstream):
        if y.creator is None and not y.requires_grad:
            continue  # an output that depends on no differentiated input
        y.backward(g, retain_graph=True)
    numeric = numerical_grad(fn, arrays, eps=eps, grad_outputs=upstream, wrt=diff)
    for i in diff:
        t = tensors[i]
        analytic = numpy.zeros(t.shape) if t.grad is None else as_numpy(t.grad)
        if analytic.shape != numeric[i].shape:
            raise AssertionError(
                f"gradcheck: input {i} has shape {numeric[i].shape} but its gradient has "
                f"shape {analytic.shape}"
            )
        err = numpy.abs(analytic - numeric[i])
        allowed = atol + rtol * numpy.abs(numeric[i])
        if not numpy.all(err <= allowed):  # also catches NaN
            excess = numpy.where(numpy.isnan(err), numpy.inf, err - allowed)
            worst = numpy.unravel_index(int(numpy.argmax(excess)), err.shape)
            n_bad = int(numpy.sum(~(err <= allowed)))
            raise AssertionError(
                f"gradcheck: input {i} (shape {numeric[i].shape}): {n_bad} of {err.size} "
                f"elements differ; worst at {tuple(int(w) for w in worst)}: analytic "
                f"{analytic[worst]:.8g}, numeric {numeric[i][worst]:.8g}, |diff| "
                f"{err[worst]:.3g} > atol + rtol*|numeric| = {allowed[worst]:.3g}"
            )
    return True
