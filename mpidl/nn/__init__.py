"""Modules and layers: parameters registered in definition order, deterministic init.

Public names: :class:`Module`, :class:`Parameter`, layers (:class:`Linear`,
:class:`Embedding`, :class:`EmbeddingBag`, :class:`LayerNorm`, :class:`Dropout`,
:class:`MultiHeadAttention`, :class:`TransformerEncoderLayer`), containers
(:class:`Sequential`, :class:`ModuleList`), activation modules (:class:`ReLU`,
:class:`GELU`, :class:`Tanh`) and the initialisers in :mod:`mpidl.nn.init`.
"""
from mpidl.nn import init
from mpidl.nn.activation import GELU, ReLU, Tanh
from mpidl.nn.attention import MultiHeadAttention
from mpidl.nn.container import ModuleList, Sequential
from mpidl.nn.dropout import Dropout
from mpidl.nn.embedding import Embedding, EmbeddingBag
from mpidl.nn.linear import Linear
from mpidl.nn.module import Module, Parameter
from mpidl.nn.norm import LayerNorm
from mpidl.nn.transformer import TransformerEncoderLayer

__all__ = [
    "Module", "Parameter", "init",
    "Linear", "Embedding", "EmbeddingBag", "LayerNorm", "Dropout",
    "MultiHeadAttention", "TransformerEncoderLayer",
    "Sequential", "ModuleList", "ReLU", "GELU", "Tanh",
]
