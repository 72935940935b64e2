"""What a model and its inputs need of a dataset, without the shards: its description.

A trained model is tied to its dataset by more than its weights: the input shape and
dtype, the number of classes and their names, and for text the vocabulary, the
sequence length and the tokenizer that turned words into ids. All of that is in the
split's manifest, outside its shard list. :class:`DatasetDescription` reads it there;
:class:`~mpidl.data.hdf5.ShardedDataset` is one (with shards to read), and so is the
manifest of the training split kept without its shards (:func:`write_description`), which
is how a run directory keeps what it needs to predict after the dataset is deleted.

The description file is the train split's ``manifest.json`` without ``shards`` and
``num_samples`` (they describe files that need not exist any more), plus ``described``:
the split's path and sample count when it was written::

    {"format": "mpidl.dataset", "format_version": 1, "dataset_id": "...", "split": "train",
     "features": {"x": {"dtype": "<i4", "shape": [64]}, "y": {"dtype": "<i8", "shape": []}},
     "labels": {"feature": "y", "num_classes": 2},
     "metadata": {"classes": ["negative", "positive"], "vocab": ["<pad>", "<unk>", ...],
                  "tokenizer": {"name": "mpidl.words", "version": 1, ...}, "length": 64},
     "described": {"path": "/data/reviews/train", "num_samples": 6000}, ...}

Read back (:func:`read_description`) it is checked as a manifest is, so a damaged or
edited file is a :class:`~mpidl.data.format.DataError` naming it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy

from mpidl.data import text as text_mod
from mpidl.data.format import DataError, Feature, Manifest, _dumps, parse_manifest


class DatasetDescription:
    """A dataset split as a model sees it: features, classes, vocabulary (no shards).

    Args:
        manifest: the split's manifest (its shard list is not used).
        path: where it was read, named in errors (a split directory or a description file).
    """

    def __init__(self, manifest: Manifest, path: str) -> None:
        self.manifest = manifest
        self.features: dict[str, Feature] = manifest.features
        self.path = path

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest.metadata

    @property
    def vocab(self) -> list[str] | None:
        """The vocabulary (index = token id) of a text dataset, else None."""
        return self.manifest.metadata.get("vocab")

    @property
    def classes(self) -> list[str] | None:
        """The class names (index = label id), if the writer stored them."""
        return self.manifest.metadata.get("classes")

    @property
    def num_classes(self) -> int | None:
        labels = self.manifest.labels
        return None if labels is None else int(labels["num_classes"])

    @property
    def pad_id(self) -> int | None:
        """The token id of padding in a text dataset, which models leave out, else None
        (:attr:`mpidl.data.format.Manifest.pad_id`)."""
        return self.manifest.pad_id

    def class_name(self, label: int) -> str:
        """The name of class ``label``: the stored name, or the id itself as text."""
        classes = self.classes or []
        return str(classes[label]) if 0 <= label < len(classes) else str(label)

    def encode_texts(self, texts: Sequence[str]) -> numpy.ndarray:
        """Token ids of ``texts``, ``(len(texts), length)``, exactly as the dataset's texts
        were encoded when it was written: the same tokenizer, vocabulary and length.

        Raises:
            DataError: the dataset is not text (no vocabulary), or its tokenizer is not
                this mpidl's.
        """
        x = self.features.get("x")
        if self.vocab is None or x is None or len(x.shape) != 1:
            shape = f"{x.dtype.name}{list(x.shape)}" if x is not None else "none"
            raise DataError(f"{self.path}: the dataset has no vocabulary (its inputs 'x' are "
                            f"{shape}), so text cannot be encoded for it: pass its feature "
                            "rows in an .npz or .h5 file instead")
        used = self.metadata.get("tokenizer", text_mod.TOKENIZER)
        if used != text_mod.TOKENIZER:
            raise DataError(
                f"{self.path}: the dataset's texts were tokenised by {used.get('name')!r} "
                f"version {used.get('version')}, this mpidl tokenises with "
                f"{text_mod.TOKENIZER['name']!r} version {text_mod.TOKENIZER['version']}: "
                "use the mpidl that wrote the dataset, or pass token ids in an .npz file")
        ids = text_mod.encode(texts, self.vocab, x.shape[0])
        return ids.astype(x.dtype, copy=False)


def description_json(manifest: Manifest, path: str) -> dict[str, Any]:
    """The description of the split at ``path`` (see the module docstring), as JSON."""
    data = manifest.to_json()
    data.pop("shards")
    data.pop("num_samples")
    data["described"] = {"path": os.path.abspath(path), "num_samples": manifest.num_samples}
    return data


def write_description(path: str, manifest: Manifest, split_path: str) -> str:
    """Write the description of the split at ``split_path`` to the file ``path``,
    atomically. Not collective: one rank writes."""
    from hpc.files import write_text

    return write_text(path, _dumps(description_json(manifest, split_path)) + "\n")


def read_description(path: str) -> DatasetDescription:
    """Read a description file written by :func:`write_description`.

    Raises:
        DataError: no such file, not JSON, or not a valid description; names the file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file", [(path, "missing")]) from None
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise DataError(f"{path}: not a readable dataset description ({e}); delete it to use "
                        "the dataset named in the run's config.toml", [(path, str(e))]) from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: not a dataset description (a JSON object)", [(path, "not an "
                                                                                "object")])
    fields = {k: v for k, v in data.items() if k != "described"}
    manifest = parse_manifest({**fields, "shards": []}, os.path.dirname(path) or ".", path)
    return DatasetDescription(manifest, path)
