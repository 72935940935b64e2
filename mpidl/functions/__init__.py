"""Differentiable operations on :class:`mpidl.autograd.Tensor` (NumPy or CuPy data).

Every function takes Tensors (or raw xp arrays and Python scalars where that makes
sense) and returns a Tensor; the same code runs on NumPy and CuPy, the array module
being found from the arguments. Modules by op family:

- :mod:`~mpidl.functions.math`: add, sub, mul, div, neg, pow, matmul, sum, mean, exp, log
- :mod:`~mpidl.functions.array`: reshape, transpose, getitem, concat, stack, broadcast_to
- :mod:`~mpidl.functions.activation`: relu, tanh, sigmoid, gelu, softmax, log_softmax
- :mod:`~mpidl.functions.loss`: softmax_cross_entropy, mean_squared_error
- :mod:`~mpidl.functions.norm`: layer_norm
- :mod:`~mpidl.functions.dropout`: dropout
- :mod:`~mpidl.functions.embedding`: embedding, embedding_bag (sparse-aware backward,
  ``weight.grad_row_mask``)
- :mod:`~mpidl.functions.attention`: scaled_dot_product_attention
"""
from mpidl.functions.activation import erf, gelu, log_softmax, relu, sigmoid, softmax, tanh
from mpidl.functions.array import broadcast_to, concat, getitem, reshape, stack, transpose
from mpidl.functions.attention import causal_mask, scaled_dot_product_attention
from mpidl.functions.dropout import dropout
from mpidl.functions.embedding import embedding, embedding_bag
from mpidl.functions.loss import mean_squared_error, softmax_cross_entropy
from mpidl.functions.math import (
    add,
    div,
    exp,
    log,
    matmul,
    mean,
    mul,
    neg,
    pow,
    sub,
    sum,
    sum_to,
)
from mpidl.functions.norm import layer_norm

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "matmul", "sum", "mean", "exp", "log",
    "sum_to",
    "reshape", "transpose", "getitem", "concat", "stack", "broadcast_to",
    "relu", "tanh", "sigmoid", "gelu", "softmax", "log_softmax", "erf",
    "softmax_cross_entropy", "mean_squared_error",
    "layer_norm", "dropout", "embedding", "embedding_bag",
    "scaled_dot_product_attention", "causal_mask",
]
