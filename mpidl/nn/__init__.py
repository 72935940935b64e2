"""Modules and layers: parameters registered in definition order, deterministic init.

Public names: :class:`Module`, :class:`Parameter`, layers (:class:`Linear`,
:class:`Embedding`, :class:`EmbeddingBag`, :class:`LayerNorm`, :class:`Dropout`,
:class:`MultiHeadAttention`, :class:`TransformerEncoderLayer`), convolutions
(:class:`Conv1d`, :class:`Conv2d`, :class:`Conv3d`), pooling (:class:`MaxPool1d`/2d/3d,
:class:`AvgPool1d`/2d/3d, :class:`AdaptiveAvgPool1d`/2d/3d), batch normalisation
(:class:`BatchNorm1d`/2d/3d, any rank: :class:`BatchNorm`; running statistics are
buffers), containers (:class:`Sequential`, :class:`ModuleList`), :class:`Flatten`,
activation modules (:class:`ReLU`, :class:`LeakyReLU`, :class:`GELU`, :class:`Tanh`),
:class:`Standardize` (a fixed per-column scale: the train split's statistics) and the
initialisers in :mod:`mpidl.nn.init`.
"""
from mpidl.nn import init
from mpidl.nn.activation import GELU, LeakyReLU, ReLU, Tanh
from mpidl.nn.array import Flatten
from mpidl.nn.attention import MultiHeadAttention
from mpidl.nn.container import ModuleList, Sequential
from mpidl.nn.conv import Conv1d, Conv2d, Conv3d
from mpidl.nn.dropout import Dropout
from mpidl.nn.embedding import Embedding, EmbeddingBag
from mpidl.nn.linear import Linear
from mpidl.nn.module import Module, Parameter
from mpidl.nn.norm import BatchNorm, BatchNorm1d, BatchNorm2d, BatchNorm3d, LayerNorm
from mpidl.nn.pool import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveAvgPool3d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
)
from mpidl.nn.standardize import Standardize
from mpidl.nn.transformer import TransformerEncoderLayer

__all__ = [
    "Module", "Parameter", "init",
    "Linear", "Embedding", "EmbeddingBag", "LayerNorm", "Dropout",
    "MultiHeadAttention", "TransformerEncoderLayer",
    "Sequential", "ModuleList", "ReLU", "LeakyReLU", "GELU", "Tanh", "Flatten",
    "Conv1d", "Conv2d", "Conv3d",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "Standardize",
]
