"""mpidl's gpt as a Hugging Face GPT-2, and back: the configuration and every tensor.

mpidl's gpt (:class:`mpidl.models.gpt.GPT`) is GPT-2's architecture: learned positions,
pre-LN blocks, GELU's tanh form (GPT-2's ``gelu_new``), a final LayerNorm, biases on
every projection, and by default the output layer tied to the token embedding. The map
is exact both ways, with three differences of storage:

- GPT-2's projections are ``Conv1D`` layers whose weights are ``(in, out)``; mpidl's
  ``Linear`` is ``(out, in)`` as PyTorch's: each is transposed on the way.
- The fused q, k, v projection has the same layout in both (``(B, T, 3, H, Dh)``).
- GPT-2 has dropout on the embeddings and on the attention probabilities, mpidl on the
  residual branches only: an export sets GPT-2's two to 0 and ``resid_pdrop`` to the
  model's; an import refuses a model whose other options mpidl does not have
  (``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, another activation).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping

import numpy

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
# mpidl's name inside a block -> (GPT-2's name inside ``transformer.h.<i>``, transposed)
_IN_BLOCK = {
    "norm1.weight": ("ln_1.weight", False), "norm1.bias": ("ln_1.bias", False),
    "self_attn.in_proj.weight": ("attn.c_attn.weight", True),
    "self_attn.in_proj.bias": ("attn.c_attn.bias", False),
    "self_attn.out_proj.weight": ("attn.c_proj.weight", True),
    "self_attn.out_proj.bias": ("attn.c_proj.bias", False),
    "norm2.weight": ("ln_2.weight", False), "norm2.bias": ("ln_2.bias", False),
    "linear1.weight": ("mlp.c_fc.weight", True), "linear1.bias": ("mlp.c_fc.bias", False),
    "linear2.weight": ("mlp.c_proj.weight", True), "linear2.bias": ("mlp.c_proj.bias", False),
}
_OUTSIDE = {"tok.weight": "transformer.wte.weight", "pos": "transformer.wpe.weight",
            "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
            "head.weight": "lm_head.weight"}
_FROM_HF = {hf: name for name, hf in _OUTSIDE.items()}
_FROM_HF_BLOCK = {hf: (name, t) for name, (hf, t) in _IN_BLOCK.items()}
# GPT-2's options that mpidl's gpt has no counterpart for, with the value it must have
_FIXED = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
          "reorder_and_upcast_attn": False, "add_cross_attention": False}
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both GELU's tanh form


class ConversionError(ValueError):
    """A model that cannot be mapped exactly; the message says why."""


def hf_name(name: str) -> tuple[str, bool]:
    """GPT-2's name of mpidl gpt tensor ``name``, and whether it is transposed."""
    if name in _OUTSIDE:
        return _OUTSIDE[name], False
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _IN_BLOCK:
        hf, transposed = _IN_BLOCK[m.group(2)]
        return f"transformer.h.{m.group(1)}.{hf}", transposed
    raise ConversionError(f"gpt tensor {name!r} has no GPT-2 counterpart")


def mpidl_name(name: str) -> tuple[str, bool] | None:
    """mpidl's name of GPT-2 tensor ``name`` and whether it is transposed; None for
    GPT-2's non-parameters (the causal mask buffers ``attn.bias``/``attn.masked_bias``
    of older files)."""
    name = name[len("transformer."):] if name.startswith("transformer.") else name
    full = name if name == "lm_head.weight" else f"transformer.{name}"
    if full in _FROM_HF:
        return _FROM_HF[full], False
    m = re.fullmatch(r"h\.(\d+)\.(.+)", name)
    if m and m.group(2) in _FROM_HF_BLOCK:
        mine, transposed = _FROM_HF_BLOCK[m.group(2)]
        return f"blocks.{m.group(1)}.{mine}", transposed
    if m and m.group(2) in ("attn.bias", "attn.masked_bias"):
        return None
    raise ConversionError(f"GPT-2 tensor {name!r} has no counterpart in mpidl's gpt")


def config(options: Mapping[str, Any], dtype: str = "float32") -> dict[str, Any]:
    """GPT-2's ``config.json`` for a gpt built with ``options`` (vocab, seq_len, dim,
    layers, heads, ffn, dropout, tie_weights)."""
    dim = int(options["dim"])
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": int(options["vocab"]), "n_positions": int(options["seq_len"]),
        "n_embd": dim, "n_layer": int(options["layers"]), "n_head": int(options["heads"]),
        "n_inner": int(options.get("ffn") or 4 * dim), "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "resid_pdrop": float(options.get("dropout", 0.0)),
        "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": bool(options.get("tie_weights", True)),
        "torch_dtype": dtype, **_FIXED,
    }


def options(hf: Mapping[str, Any]) -> dict[str, Any]:
    """mpidl gpt's options for GPT-2 ``config.json`` ``hf``; ConversionError for one
    mpidl cannot reproduce exactly."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ConversionError(f"model_type {hf.get('model_type')!r} is not gpt2")
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise ConversionError(f"activation_function {act!r}: mpidl's gpt uses GELU's tanh "
                              f"form ({' or '.join(_ACTIVATIONS)})")
    for key, value in _FIXED.items():
        if bool(hf.get(key, value)) != value:
            raise ConversionError(f"{key}={hf[key]!r}: mpidl's gpt has only {value}")
    if float(hf.get("layer_norm_epsilon", 1e-5)) != 1e-5:
        raise ConversionError(f"layer_norm_epsilon={hf['layer_norm_epsilon']}: mpidl's gpt "
                              "uses 1e-5")
    dim = int(hf["n_embd"])
    return {"vocab": int(hf["vocab_size"]), "seq_len": int(hf["n_positions"]), "dim": dim,
            "layers": int(hf["n_layer"]), "heads": int(hf["n_head"]),
            "ffn": int(hf.get("n_inner") or 4 * dim),
            "dropout": float(hf.get("resid_pdrop", 0.0)),
            "tie_weights": bool(hf.get("tie_word_embeddings", True))}


def to_hf(tensors: Iterable[tuple[str, tuple, Any, Callable[[], Any]]]
          ) -> list[tuple[str, tuple, Any, Callable[[], Any]]]:
    """mpidl gpt's ``(name, shape, dtype, make)`` as GPT-2's, transposing lazily."""
    out = []
    for name, shape, dtype, make in tensors:
        hf, transposed = hf_name(name)
        if transposed:
            shape = tuple(reversed(shape))
            make = (lambda make=make: numpy.ascontiguousarray(numpy.asarray(make()).T))
        out.append((hf, tuple(shape), dtype, make))
    return out


def from_hf(tensors: Mapping[str, Any]) -> dict[str, numpy.ndarray]:
    """GPT-2's tensors by name as mpidl gpt's state dict (a tied ``lm_head.weight``,
    equal to the embedding, is dropped)."""
    state: dict[str, numpy.ndarray] = {}
    for name, value in tensors.items():
        mapped = mpidl_name(name)
        if mapped is None:
            continue
        mine, transposed = mapped
        array = numpy.asarray(value)
        state[mine] = numpy.ascontiguousarray(array.T) if transposed else array
    return state


__all__ = ["ConversionError", "hf_name", "mpidl_name", "config", "options", "to_hf", "from_hf"]
