"""The PyTorch modules that match mpidl's reference models, tensor name for tensor name.

``mpidl export --format torch`` (or safetensors) keeps mpidl's names; these modules
register their parameters and buffers under the same names and compute the same
function, so ``torch_module(...).load_state_dict(torch.load(out, weights_only=True),
strict=True)`` takes an exported mlp or bag of words as it is. The gpt goes to
``transformers`` instead (``--format hf-gpt2``). PyTorch is imported when a module is
built, never at import.
"""
from __future__ import annotations

from typing import Any, Mapping

MODELS = ("mlp", "bow")


def torch_module(model: str, options: Mapping[str, Any]) -> Any:
    """The PyTorch module of mpidl model ``model`` built with ``options`` (the export's
    ``mpidl_options`` metadata), with freshly initialised values."""
    import torch  # here: only this function needs PyTorch
    from torch import nn

    class Standardize(nn.Module):
        def __init__(self, width: int, inverse: bool) -> None:
            super().__init__()
            self.inverse = inverse
            self.register_buffer("mean", torch.zeros(width))
            self.register_buffer("std", torch.ones(width))

        def forward(self, x):
            flat = x.reshape(x.shape[0], -1)
            out = flat * self.std + self.mean if self.inverse else (flat - self.mean) / self.std
            return out.reshape(x.shape)

    class MLP(nn.Module):
        def __init__(self, sizes, inputs: bool, targets: bool) -> None:
            super().__init__()
            self.inputs = Standardize(sizes[0], False) if inputs else None
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
            self.targets = Standardize(sizes[-1], True) if targets else None

        def forward(self, x):
            if self.inputs is not None:
                x = self.inputs(x)
            x = x.reshape(x.shape[0], -1)
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = torch.relu(x)
            return x if self.targets is None else self.targets(x)

    class BagOfWords(nn.Module):
        def __init__(self, vocab, dim, hidden, classes, pad_id) -> None:
            super().__init__()
            self.embed = nn.EmbeddingBag(vocab, dim, mode="mean", padding_idx=pad_id)
            self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, classes)

        def forward(self, ids):
            return self.fc2(torch.relu(self.fc1(self.embed(ids))))

    if model == "mlp":
        return MLP(list(options["sizes"]), bool(options.get("input_stats")),
                   bool(options.get("target_stats")))
    if model == "bow":
        return BagOfWords(int(options.get("vocab", 20000)), int(options.get("dim", 128)),
                          int(options.get("hidden", 256)), int(options.get("classes", 2)),
                          options.get("pad_id"))
    raise ValueError(f"no PyTorch module for model {model!r}; these have one: "
                     f"{', '.join(MODELS)} (a gpt exports as a Hugging Face GPT-2)")


__all__ = ["MODELS", "torch_module"]
