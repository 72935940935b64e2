"""The on-disk format of a sharded dataset (version 1): the manifest and its checks.

A dataset split is a directory::

    OUT/train/
      manifest.json          # the single source of truth; written last, atomically
      shard-00000.h5         # every shard holds the same named datasets: /x, /y, ...
      shard-00001.h5
    OUT/test/
      manifest.json          # same features, same vocabulary and classes as train
      shard-00000.h5

``manifest.json`` (``format_version`` 1)::

    {"format": "mpidl.dataset", "format_version": 1,
     "dataset_id": "8c1f...",            # uuid4, also stored in every shard's attributes
     "split": "train", "created": "2025-01-01T00:00:00Z",
     "writer": {"mpidl": "0.1.0", "h5py": "3.16.0", "hdf5": "2.0.0"},
     "features": {"x": {"dtype": "<i4", "shape": [256]},   # per-sample shape
                  "y": {"dtype": "<i8", "shape": []}},
     "storage": {"layout": "contiguous"},  # or {"layout": "chunked", "chunk_rows": 256,
                                           #     "compression": "gzip", "compression_opts": 4}
     "num_samples": 45000,
     "shards": [{"file": "shard-00000.h5", "rows": 32768, "bytes": 33556480,
                 "sha256": "9981a66e..."}, ...],
     "labels": {"feature": "y", "num_classes": 2},        # optional: range-checked labels
     "metadata": {"classes": ["negative", "positive"],   # free-form, e.g. text datasets:
                  "vocab": ["<pad>", "<unk>", "the", ...], "tokenizer": {...},
                  "pad_id": 0,                         # the padding token id (text)
                  "length": 256,                       # tokens per sample (text), and how
                  "length_choice": {"chosen": "auto", ...},  # it was chosen (writer.py)
                  "stats": {"samples": 45000, "classes": {...}, ...}}}  # stats.py

Samples are numbered ``0 .. num_samples - 1`` in shard order. Each shard's root
attributes repeat ``format``, ``format_version``, ``dataset_id``, ``shard_index`` and
``rows``, so a shard copied into the wrong directory is recognised.

Why this layout (measured in the project's HDF5 study): contiguous, unfiltered datasets
are the fastest to read in runs (a copy from the dataset's byte offset in a memory map
of the file skips HDF5's per-call cost); compression pays only when storage is the
bottleneck, so it is an option. SHA-256 of whole files is kept because flipped bytes
inside contiguous raw data are otherwise silent; hashing is an explicit
``mpidl shard --verify``, not a start-up cost.

A newer ``format_version`` is refused; optional fields may be added without bumping it.
Text datasets written before ``pad_id`` was stored pad with ``<pad>``, vocabulary id 0
(:attr:`Manifest.pad_id` says so for both).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Any

import numpy

from mpidl.data.text import PAD, PAD_ID

FORMAT = "mpidl.dataset"
SHARD_FORMAT = "mpidl.shard"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


# The most classes a dataset may declare. The largest single-label classification sets
# have 10^4 to 10^6 classes (ImageNet-21k: 21,841; face-identity sets: about 10^6), and
# 2^24 leaves room above them; a larger value is a corrupt or mistaken manifest (a
# sample id taken for a label), refused before a model turns it into an allocation: with
# num_classes = 10^9 the reviews model's output layer alone was a 1.86 TiB array. A fixed
# cap, not "at most the number of samples": a small test split, or a train split with
# rare classes, may well have fewer samples than classes.
MAX_CLASSES = 1 << 24


class DataError(ValueError):
    """A dataset or an input file is missing, corrupt or inconsistent.

    The message names the file, the problem and, where there is one, the fix.
    ``problems`` lists ``(path, problem)`` pairs when several files are bad.
    """

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.problems = problems or []


def shard_name(index: int) -> str:
    """The file name of shard ``index``: ``shard-00007.h5``."""
    return f"shard-{index:05d}.h5"


def sha256_file(path: str, block: int = 1 << 22) -> str:
    """The hex SHA-256 of a whole file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Feature:
    """One named per-sample array: its dtype (explicit byte order) and per-sample shape."""

    name: str
    dtype: numpy.dtype
    shape: tuple[int, ...]

    @functools.cached_property
    def row_bytes(self) -> int:
        """Bytes per sample (cached: the loader asks on every read)."""
        return int(self.dtype.itemsize * numpy.prod(self.shape, dtype=numpy.int64))

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype.str, "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard file of a split: its name inside the directory, row count, size, hash."""

    file: str
    rows: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}


@dataclasses.dataclass
class Manifest:
    """The parsed ``manifest.json`` of one split directory."""

    features: dict[str, Feature]
    shards: list[Shard]
    dataset_id: str
    split: str = "train"
    storage: dict[str, Any] = dataclasses.field(default_factory=lambda: {"layout": "contiguous"})
    labels: dict[str, Any] | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    created: str = ""
    writer: dict[str, str] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def num_samples(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def pad_id(self) -> int | None:
        """The token id that pads a text dataset's samples, which models leave out.

        ``metadata["pad_id"]`` when the writer stored it; 0 for a text dataset written
        before it did (its vocabulary starts with ``<pad>``); None for other datasets.
        """
        pad = self.metadata.get("pad_id")
        if pad is not None:
            return int(pad)
        vocab = self.metadata.get("vocab")
        return PAD_ID if isinstance(vocab, list) and vocab[:1] == [PAD] else None

    def to_json(self) -> dict[str, Any]:
        out = {
            "format": FORMAT,
            "format_version": self.format_version,
            "dataset_id": self.dataset_id,
            "split": self.split,
            "created": self.created,
            "writer": self.writer,
            "features": {n: f.to_json() for n, f in self.features.items()},
            "storage": self.storage,
            "num_samples": self.num_samples,
            "shards": [s.to_json() for s in self.shards],
        }
        if self.labels is not None:
            out["labels"] = self.labels
        out["metadata"] = self.metadata
        return out


def check_num_classes(num_classes: int, where: str, fix: str) -> None:
    """Raise DataError naming ``where`` if ``num_classes`` exceeds :data:`MAX_CLASSES`."""
    _require(
        num_classes <= MAX_CLASSES,
        where,
        f"num_classes {num_classes} is more than the {MAX_CLASSES} (2**24) classes mpidl "
        f"accepts, far beyond any real classification task (a model would allocate an "
        f"output layer of {num_classes} rows); {fix}",
    )


def _require(cond: bool, path: str, problem: str) -> None:
    if not cond:
        raise DataError(f"{path}: {problem}", [(path, problem)])


def _safe_shard_file(directory: str, name: Any, where: str) -> str:
    # A manifest is data, possibly from elsewhere: a name like "../../etc/passwd" or an
    # absolute path must never make the reader open a file outside the dataset.
    _require(
        isinstance(name, str) and name != "",
        where,
        f"shard file name {name!r} is not a non-empty string",
    )
    _require(
        "\0" not in name,
        where,
        f"shard file name {name!r} holds a NUL byte, which no file name can: the manifest "
        "is corrupt; re-copy the dataset or rewrite it with `mpidl shard`",
    )
    bad = (
        os.path.isabs(name)
        or name.startswith(("/", "\\"))
        or "\\" in name
        or any(part in ("..", "") for part in name.split("/"))
    )
    root = os.path.realpath(directory)
    full = os.path.realpath(os.path.join(root, name))
    escapes = bad or os.path.commonpath([root, full]) != root
    _require(
        not escapes,
        where,
        f"shard file name {name!r} escapes the dataset directory {directory!r}; "
        "shard names must be plain relative paths inside it (e.g. 'shard-00000.h5')",
    )
    return name


def parse_manifest(data: Any, directory: str, where: str) -> Manifest:
    """Validate a decoded ``manifest.json`` and return it as a :class:`Manifest`.

    Args:
        data: the decoded JSON object.
        directory: the split directory, to check that shard names stay inside it.
        where: the manifest's path, named in errors.

    Raises:
        DataError: the manifest is not a version-1 mpidl manifest, or a field is invalid.
    """
    _require(isinstance(data, dict), where, "manifest is not a JSON object")
    _require(
        data.get("format") == FORMAT,
        where,
        f"format is {data.get('format')!r}, expected {FORMAT!r}: not an mpidl dataset manifest",
    )
    version = data.get("format_version")
    _require(isinstance(version, int), where, f"format_version {version!r} is not an integer")
    _require(
        version <= FORMAT_VERSION,
        where,
        f"format_version {version} is newer than this reader (supports {FORMAT_VERSION}): "
        "upgrade mpidl",
    )
    _require(version >= 1, where, f"format_version {version} is invalid (must be >= 1)")
    for key in ("features", "shards", "dataset_id"):
        _require(key in data, where, f"missing required field {key!r}")
    feats = data["features"]
    _require(isinstance(feats, dict) and feats, where, "'features' must be a non-empty object")
    features = {}
    for name, spec in feats.items():
        _require(
            isinstance(spec, dict) and "dtype" in spec and "shape" in spec,
            where,
            f"feature {name!r} needs 'dtype' and 'shape'",
        )
        try:
            dtype = numpy.dtype(spec["dtype"])
        except TypeError as e:
            raise DataError(f"{where}: feature {name!r} has invalid dtype {spec['dtype']!r} ({e})")
        shape = spec["shape"]
        _require(
            isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape),
            where,
            f"feature {name!r} has invalid shape {shape!r} (a list of sizes >= 0)",
        )
        features[name] = Feature(name, dtype, tuple(shape))
    _require(isinstance(data["shards"], list), where, "'shards' must be a list")
    shards, seen = [], set()
    for i, s in enumerate(data["shards"]):
        _require(
            isinstance(s, dict) and {"file", "rows", "bytes", "sha256"} <= set(s),
            where,
            f"shard entry {i} needs 'file', 'rows', 'bytes' and 'sha256'",
        )
        name = _safe_shard_file(directory, s["file"], where)
        _require(name not in seen, where, f"shard file {name!r} is listed twice")
        seen.add(name)
        for key in ("rows", "bytes"):
            _require(
                isinstance(s[key], int) and s[key] >= 0,
                where,
                f"shard {name!r}: {key} {s[key]!r} is not an integer >= 0",
            )
        shards.append(Shard(name, s["rows"], s["bytes"], str(s["sha256"])))
    total = sum(s.rows for s in shards)
    if "num_samples" in data:
        _require(
            data["num_samples"] == total,
            where,
            f"num_samples {data['num_samples']} != sum of shard rows {total}",
        )
    labels = data.get("labels")
    if labels is not None:
        _require(
            isinstance(labels, dict)
            and labels.get("feature") in features
            and isinstance(labels.get("num_classes"), int)
            and labels["num_classes"] >= 1,
            where,
            f"'labels' {labels!r} must name a feature and give num_classes >= 1",
        )
        check_num_classes(labels["num_classes"], where, "the manifest is corrupt or was "
                          "edited: rewrite the dataset with `mpidl shard`")
    metadata = data.get("metadata") or {}
    _require(isinstance(metadata, dict), where, f"'metadata' {metadata!r} is not an object")
    _check_pad_id(metadata, where)
    return Manifest(
        features=features,
        shards=shards,
        dataset_id=str(data["dataset_id"]),
        split=str(data.get("split", "train")),
        storage=dict(data.get("storage") or {"layout": "contiguous"}),
        labels=labels,
        metadata=dict(metadata),
        created=str(data.get("created", "")),
        writer=dict(data.get("writer") or {}),
        format_version=version,
    )


def _check_pad_id(metadata: dict[str, Any], where: str) -> None:
    # Models compare token ids with pad_id to leave padding out: a pad_id of the wrong
    # type ("0") or outside the vocabulary would silently mask nothing.
    if "pad_id" not in metadata:
        return
    pad, vocab = metadata["pad_id"], metadata.get("vocab")
    size = len(vocab) if isinstance(vocab, list) else None
    _require(
        isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0
        and (size is None or pad < size),
        where,
        f"metadata pad_id {pad!r} is not a token id"
        + (f" in [0, {size}) (the vocabulary's size)" if size is not None else " (an int >= 0)")
        + ": the manifest is corrupt or was edited; rewrite the dataset with `mpidl shard`",
    )


def read_manifest(directory: str) -> Manifest:
    """Read and validate ``directory/manifest.json``.

    Raises:
        DataError: no manifest (with a hint when ``directory`` holds ``train/``/``test/``
            split directories), invalid JSON, or an invalid field.
    """
    path = os.path.join(directory, MANIFEST_NAME)
    if not os.path.isfile(path):
        splits = [
            d
            for d in ("train", "test")
            if os.path.isfile(os.path.join(directory, d, MANIFEST_NAME))
        ]
        hint = (
            f"; it holds the splits {splits}: pass {os.path.join(directory, splits[0])!r}"
            if splits
            else "; write one with `mpidl shard ... OUT_DIR`"
        )
        raise DataError(
            f"{path}: no manifest.json, so {directory!r} is not a dataset split{hint}",
            [(path, "missing manifest")],
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"{path}: not valid JSON ({e}); rewrite the dataset with `mpidl shard`",
            [(path, "invalid JSON")],
        ) from e
    return parse_manifest(data, directory, path)


def _dumps(obj: Any, indent: str = "") -> str:
    # Indented JSON, except that lists of plain values (a 20000-word vocabulary, a shape)
    # stay on one line, so the file is readable and the shard list easy to scan.
    inner = indent + " "
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + _dumps(v, inner) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj)


def write_manifest(directory: str, manifest: Manifest) -> str:
    """Write ``directory/manifest.json`` atomically (temporary file, then rename).

    A reader therefore sees either no manifest or a complete one, never a half-written
    file: the manifest is written after every shard it lists.
    """
    path = os.path.join(directory, MANIFEST_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(_dumps(manifest.to_json()) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
