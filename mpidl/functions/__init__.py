"""Differentiable operations on :class:`mpidl.autograd.Tensor` (NumPy or CuPy data).

Every function takes Tensors (or raw xp arrays and Python scalars where that makes
sense) and returns a Tensor; the same code runs on NumPy and CuPy, the array module
being found from the arguments. Modules by op family:

- :mod:`~mpidl.functions.math`: add, sub, mul, div, neg, pow, matmul, sum, mean, exp, log
- :mod:`~mpidl.functions.array`: reshape, transpose, getitem, concat, stack, broadcast_to
- :mod:`~mpidl.functions.activation`: relu, leaky_relu, tanh, sigmoid, gelu, softmax,
  log_softmax
- :mod:`~mpidl.functions.loss`: softmax_cross_entropy, mean_squared_error, regression_loss
- :mod:`~mpidl.functions.norm`: layer_norm
- :mod:`~mpidl.functions.batchnorm`: batch_norm (optionally over ranks: ``allreduce=``)
- :mod:`~mpidl.functions.conv`: conv1d, conv2d, conv3d (any ``convolution``: stride,
  padding, dilation, groups)
- :mod:`~mpidl.functions.pool`: max_pool1d/2d/3d, avg_pool1d/2d/3d,
  adaptive_avg_pool1d/2d/3d
- :mod:`~mpidl.functions.dropout`: dropout
- :mod:`~mpidl.functions.embedding`: embedding, embedding_bag (sparse-aware backward,
  ``weight.grad_row_mask``)
- :mod:`~mpidl.functions.attention`: scaled_dot_product_attention
"""
from mpidl.functions.activation import (
    erf,
    gelu,
    leaky_relu,
    log_softmax,
    relu,
    sigmoid,
    softmax,
    tanh,
)
from mpidl.functions.array import broadcast_to, concat, getitem, reshape, stack, transpose
from mpidl.functions.attention import causal_mask, scaled_dot_product_attention
from mpidl.functions.batchnorm import batch_norm
from mpidl.functions.conv import conv1d, conv2d, conv3d, convolution
from mpidl.functions.dropout import dropout
from mpidl.functions.embedding import embedding, embedding_bag
from mpidl.functions.loss import mean_squared_error, regression_loss, softmax_cross_entropy
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
from mpidl.functions.pool import (
    adaptive_avg_pool,
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    avg_pool,
    avg_pool1d,
    avg_pool2d,
    avg_pool3d,
    max_pool,
    max_pool1d,
    max_pool2d,
    max_pool3d,
)

__all__ = [
    "add", "sub", "mul", "div", "neg", "pow", "matmul", "sum", "mean", "exp", "log",
    "sum_to",
    "reshape", "transpose", "getitem", "concat", "stack", "broadcast_to",
    "relu", "leaky_relu", "tanh", "sigmoid", "gelu", "softmax", "log_softmax", "erf",
    "softmax_cross_entropy", "mean_squared_error", "regression_loss",
    "layer_norm", "batch_norm", "dropout", "embedding", "embedding_bag",
    "scaled_dot_product_attention", "causal_mask",
    "convolution", "conv1d", "conv2d", "conv3d",
    "max_pool", "max_pool1d", "max_pool2d", "max_pool3d",
    "avg_pool", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
]
