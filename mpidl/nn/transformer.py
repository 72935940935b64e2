"""The pre-LN transformer encoder layer (Xiong et al. 2020; GPT-2's block)."""
from __future__ import annotations

from typing import Any

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.nn import init
from mpidl.nn.attention import MultiHeadAttention
from mpidl.nn.dropout import Dropout
from mpidl.nn.linear import Linear
from mpidl.nn.module import Module, default_dtype
from mpidl.nn.norm import LayerNorm
from mpidl.nn.recompute import check_recompute, checkpoint


class TransformerEncoderLayer(Module):
    """``x + attn(norm1(x))``, then ``h + linear2(gelu(linear1(norm2(h))))``.

    The same computation (and parameter shapes) as PyTorch's
    ``nn.TransformerEncoderLayer(dim, heads, ffn, dropout, activation="gelu",
    norm_first=True, batch_first=True)``, with one difference when ``dropout > 0``:
    dropout is applied to the two residual branches only (as nanoGPT does), not to the
    attention probabilities or after the activation.

    Args:
        dim: model width D.
        heads: attention heads; must divide ``dim``.
        ffn: hidden width of the feed-forward block.
        dropout: drop probability on the residual branches (0 disables it).
        causal: causal self-attention (for language models).
        approximate: GELU form, ``"none"`` (erf, PyTorch's) or ``"tanh"`` (GPT-2's).
        eps: LayerNorm epsilon.
        recompute: what backward recomputes instead of keeping (:mod:`mpidl.nn.recompute`):
            ``"none"``, ``"selective"`` (the attention probabilities) or ``"full"``
            (everything but the input). The ``recompute`` attribute may be changed
            later; the gradients are the same in every mode.
        seed, rng: where the initial values (and dropout masks) come from.
        dtype: parameter dtype (float32 by default).
    """

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float = 0.0,
                 causal: bool = False, approximate: str = "none", eps: float = 1e-5,
                 recompute: str = "none", *, seed: int | None = None,
                 rng: numpy.random.Generator | None = None, dtype: Any = None) -> None:
        super().__init__()
        rng = init.make_rng(seed, rng)
        dtype = default_dtype(dtype)
        self.approximate = approximate
        self.recompute = check_recompute(recompute)
        self.norm1 = LayerNorm(dim, eps, dtype=dtype)
        self.self_attn = MultiHeadAttention(dim, heads, causal, rng=rng, dtype=dtype)
        self.norm2 = LayerNorm(dim, eps, dtype=dtype)
        self.linear1 = Linear(dim, ffn, rng=rng, dtype=dtype)
        self.linear2 = Linear(ffn, dim, rng=rng, dtype=dtype)
        if dropout > 0:
            # Seeded from the layer's generator: reproducible, distinct per layer.
            self.dropout1 = Dropout(dropout, seed=int(rng.integers(2**63)))
            self.dropout2 = Dropout(dropout, seed=int(rng.integers(2**63)))
        else:
            self.dropout1 = self.dropout2 = None

    def forward(self, x: Any, mask: Any = None) -> Tensor:
        """``x`` ``(B, T, D)`` -> ``(B, T, D)``; ``mask`` goes to the attention."""
        if check_recompute(self.recompute) == "full":
            return checkpoint(lambda t: self._forward(t, mask), x, self)
        return self._forward(x, mask)

    def _forward(self, x: Any, mask: Any) -> Tensor:
        a = self.self_attn(self.norm1(x), mask=mask,
                           keep_probs=self.recompute != "selective")
        if self.dropout1 is not None:
            a = self.dropout1(a)
        h = F.add(x, a)
        f = self.linear2(F.gelu(self.linear1(self.norm2(h)), approximate=self.approximate))
        if self.dropout2 is not None:
            f = self.dropout2(f)
        return F.add(h, f)

    def extra_repr(self) -> str:
        return "" if self.recompute == "none" else f"recompute={self.recompute!r}"
