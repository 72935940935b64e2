"""A model that leaves mpidl, and one that comes in: safetensors, PyTorch state dicts and
Hugging Face GPT-2 folders (``mpidl export``, ``mpidl import``).

Importing this package imports neither torch nor transformers: :mod:`.safetensors`
reads and writes the format by hand, and only ``--format torch`` needs torch.
"""
