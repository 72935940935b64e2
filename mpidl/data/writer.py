"""Write sharded datasets: ``write_shards`` (arrays) and ``write_text_shards`` (texts).

``write_shards(OUT, {"x": x, "y": y}, test_fraction=0.1)`` writes::

    OUT/train/manifest.json, OUT/train/shard-00000.h5, ...
    OUT/test/manifest.json,  OUT/test/shard-00000.h5, ...

(see :mod:`mpidl.data.format` for the files). Rows are shuffled once, with ``seed``,
before they are split and written: the sampler's default block shuffle then draws random
groups of rows even when the input is sorted (by class, as a folder of ``pos``/``neg``
files is). Every split is checked before any file is written, then written beside the
old one (shards first, the manifest last) and put in its place only when all are
complete (:mod:`mpidl.data.publish`): a crash or a full disk never leaves a directory
that looks complete, nor destroys the dataset that was there.

The input must fit in memory (the arrays are shuffled in memory). Shards are stored
contiguous and unfiltered unless ``compression`` is given (``"gzip"`` or ``"lzf"``: then
chunked, with the byte-shuffle filter and ``fletcher32`` checksums, for sites whose
storage, not reading, is the bottleneck).
"""

from __future__ import annotations

import os
import re
import uuid
from typing import Any, Callable, Mapping, Sequence

import numpy

from mpidl.data import stats as stats_mod
from mpidl.data import text as text_mod
from mpidl.data.format import DataError, Manifest, check_num_classes, write_manifest
from mpidl.data.publish import publish_splits
from mpidl.data.shard_writer import (
    check_options,
    make_manifest,
    shard_rows,
    writer_info,
    write_rows,
)

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_arrays(arrays: Mapping[str, numpy.ndarray], source: str) -> int:
    """The common number of rows of ``arrays``; DataError if they differ or names are bad."""
    if not arrays:
        raise DataError(f"{source}: no features to write")
    for name in arrays:
        if not _NAME_RE.match(name) or name == "global_count":
            raise DataError(
                f"{source}: feature name {name!r} must be a Python identifier "
                "(letters, digits, '_') other than 'global_count'"
            )
        dtype = numpy.asarray(arrays[name]).dtype
        if dtype.name == "bfloat16":  # ml_dtypes' kind is "V": HDF5 has no bfloat16
            raise DataError(
                f"{source}: feature {name!r} has dtype bfloat16, which HDF5 shards cannot "
                "hold; convert it to float32 (exact) or float16 first"
            )
        if dtype.kind not in "biufc":
            raise DataError(
                f"{source}: feature {name!r} has dtype {dtype}; only numeric arrays can be "
                "sharded (encode text with mpidl.data.text first)"
            )
    rows = {k: len(v) if numpy.ndim(v) else -1 for k, v in arrays.items()}
    if len(set(rows.values())) != 1 or -1 in rows.values():
        raise DataError(
            f"{source}: features have different numbers of rows {rows}; every feature "
            "needs one row per sample"
        )
    return next(iter(rows.values()))


def _check_labels(
    arrays: Mapping[str, numpy.ndarray], labels: str, num_classes: int, source: str
) -> None:
    y = arrays.get(labels)
    if y is None or numpy.asarray(y).dtype.kind not in "iu" or numpy.ndim(y) != 1:
        raise DataError(
            f"{source}: labels {labels!r} must be a 1-d integer feature of {sorted(arrays)}"
        )
    check_num_classes(num_classes, source, f"are the values of {labels!r} class ids? Shard "
                      "it without labels (labels=None, `--labels none`) if not")
    bad = numpy.flatnonzero((y < 0) | (y >= num_classes))
    if bad.size:
        raise DataError(
            f"{source}: label {int(y[bad[0]])} of sample {bad[0]} is outside "
            f"[0, {num_classes}) ({bad.size} bad labels); fix the labels or num_classes"
        )


def write_split(
    directory: str,
    arrays: Mapping[str, numpy.ndarray],
    *,
    overwrite: bool = False,
    **options: Any,
) -> Manifest:
    """Write one split directory (``manifest.json`` + shards) from in-memory arrays.

    The split is written beside ``directory`` and put in its place only when complete
    (:mod:`mpidl.data.publish`): a failure leaves what was there unchanged.

    Args:
        directory: the split directory to create.
        arrays: feature name -> array; all with the same number of rows (first axis).
        overwrite: replace a dataset already in ``directory``.
        **options: ``split``, ``rows_per_shard``, ``compression``, ``labels``,
            ``num_classes``, ``metadata``, ``source`` ...: see :func:`_split_writer`.

    Raises:
        DataError: inconsistent arrays, labels out of range, ``directory`` already
            holds a dataset and ``overwrite`` is False, or a write failed (a full disk).
    """
    directory = os.path.normpath(directory)
    name = os.path.basename(directory)
    write = _split_writer(arrays, **options)
    return publish_splits(os.path.dirname(directory) or ".", {name: write},
                          overwrite=overwrite, replaces=(name,))[name]


def _split_writer(
    arrays: Mapping[str, numpy.ndarray],
    *,
    split: str = "train",
    rows_per_shard: int | None = None,
    compression: str | None = None,
    compression_opts: Any = None,
    labels: str | None = None,
    num_classes: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    stats: Mapping[str, Any] | None = None,
    dataset_id: str | None = None,
    source: str = "arrays",
) -> Callable[[str], Manifest]:
    """Check one split's arrays and options now; return the function that writes it
    into the (new) directory it is given.

    Args:
        arrays: feature name -> array; all with the same number of rows (first axis).
        rows_per_shard: rows per shard file (default: about 256 MiB per shard).
        compression: None (contiguous, fastest to read), ``"gzip"`` or ``"lzf"``.
        labels: the feature holding integer class labels, checked to lie in
            ``[0, num_classes)`` here and on every read.
        num_classes: the number of classes (default: largest label + 1).
        metadata: free JSON-serialisable metadata (vocabulary, classes, tokenizer, ...).
        stats: what the split's data is, stored as ``metadata["stats"]``; by default
            :func:`mpidl.data.stats.array_stats` of ``arrays`` (text writers pass theirs).
        source: the input's name, for error messages.
    """
    arrays = {k: numpy.ascontiguousarray(v) for k, v in arrays.items()}
    n = _check_arrays(arrays, source)
    if labels is not None:
        if num_classes is None:
            y = arrays.get(labels)
            num_classes = int(y.max()) + 1 if y is not None and n else 1
        _check_labels(arrays, labels, num_classes, source)
    storage = check_options(rows_per_shard, compression, compression_opts)
    metadata = dict(metadata or {})
    if stats is None:
        stats = stats_mod.array_stats(arrays, labels, num_classes, metadata.get("classes"))
    metadata["stats"] = dict(stats)
    per = shard_rows(arrays, rows_per_shard)
    dataset_id = dataset_id or uuid.uuid4().hex

    def write(directory: str) -> Manifest:
        os.makedirs(directory)
        writer = writer_info()
        shards = write_rows(directory, arrays, storage, per, split=split, dataset_id=dataset_id,
                            first_shard=0, num_shards=-(-n // per), first_sample=0,
                            writer=writer)
        manifest = make_manifest(arrays, shards, storage, split=split, dataset_id=dataset_id,
                                 labels=labels, num_classes=num_classes, metadata=metadata,
                                 writer=writer)
        write_manifest(directory, manifest)
        return manifest

    return write


def write_shards(
    out_dir: str,
    arrays: Mapping[str, numpy.ndarray],
    *,
    test_arrays: Mapping[str, numpy.ndarray] | None = None,
    test_fraction: float = 0.0,
    seed: int = 0,
    shuffle: bool = True,
    labels: str | None = "auto",
    num_classes: int | None = None,
    stats: Mapping[str, Mapping[str, Any]] | None = None,
    **options: Any,
) -> dict[str, Manifest]:
    """Write ``out_dir/train`` (and ``out_dir/test``) from arrays.

    Args:
        out_dir: the dataset directory; splits are written as sub-directories.
        arrays: feature name -> array (all with the same number of rows).
        test_arrays: a given test split; otherwise ``test_fraction`` of the rows
            (after shuffling) become the test split (none when 0).
        seed: seeds the shuffle and the split (the same seed gives the same files).
        shuffle: shuffle the rows before writing (recommended: see the module docstring).
        labels: the integer label feature, range-checked against ``num_classes``;
            ``"auto"`` (default) means ``"y"`` if it is a 1-d integer feature, else none.
        stats: split name -> its ``metadata["stats"]``, for splits whose statistics the
            caller knows better (text); the others get :mod:`mpidl.data.stats`'s of
            their arrays.
        **options: passed to :func:`write_split` (``rows_per_shard``, ``compression``,
            ``metadata``, ``overwrite``, ``source``, ...).

    Returns:
        ``{"train": manifest, "test": manifest}`` (``test`` only when written).
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction {test_fraction} must be in [0, 1)")
    source = options.get("source", "arrays")
    arrays = {k: numpy.asarray(v) for k, v in arrays.items()}
    n = _check_arrays(arrays, source)
    if test_arrays is not None:
        _check_arrays(test_arrays, f"{source} (test split)")
        if set(test_arrays) != set(arrays):
            raise DataError(
                f"{source}: the test split has features {sorted(test_arrays)}, "
                f"the training split {sorted(arrays)}"
            )
    rng = numpy.random.default_rng(seed)
    perm = rng.permutation(n)
    parts = {"train": perm}
    if test_arrays is None and test_fraction > 0:
        n_test = int(round(n * test_fraction))
        parts = {"train": perm[: n - n_test], "test": perm[n - n_test :]}
    if not shuffle:  # still a random split, but each split keeps the input's order
        parts = {k: numpy.sort(v) for k, v in parts.items()}
    splits = {name: {k: v[idx] for k, v in arrays.items()} for name, idx in parts.items()}
    if test_arrays is not None:
        t = {k: numpy.asarray(v) for k, v in test_arrays.items()}
        m = len(next(iter(t.values()))) if t else 0
        idx = rng.permutation(m) if shuffle else numpy.arange(m)
        splits["test"] = {k: v[idx] for k, v in t.items()}
    if labels == "auto":
        y = arrays.get("y")
        labels = "y" if y is not None and y.dtype.kind in "iu" and y.ndim == 1 else None
    if labels is not None:  # checked before the shuffle, so errors give input positions
        if num_classes is None:
            tops = [
                int(numpy.max(a[labels]))
                for a in (arrays, test_arrays or {})
                if len(a.get(labels, ()))
            ]
            num_classes = max(tops) + 1 if tops else 1
        _check_labels(arrays, labels, num_classes, source)
        if test_arrays is not None:
            _check_labels(test_arrays, labels, num_classes, f"{source} (test split)")
    # Every split is checked before any is written, and the old dataset is replaced only
    # once all are complete: both its splits, since an old test split left beside a new
    # train split would pair the wrong vocabulary with the wrong shards.
    overwrite = options.pop("overwrite", False)
    dataset_id = uuid.uuid4().hex
    writers = {
        name: _split_writer(split, split=name, labels=labels, num_classes=num_classes,
                            stats=(stats or {}).get(name), dataset_id=f"{dataset_id}-{name}",
                            **options)
        for name, split in splits.items()
    }
    return publish_splits(str(out_dir), writers, overwrite=overwrite, replaces=("train", "test"))


def write_text_shards(
    out_dir: str,
    train_texts: Sequence[str],
    train_labels: Sequence[str],
    *,
    test_texts: Sequence[str] | None = None,
    test_labels: Sequence[str] | None = None,
    test_fraction: float = 0.0,
    seed: int = 0,
    vocab_size: int = 20000,
    min_freq: int = 1,
    length: int | str = "auto",
    classes: Sequence[str] | None = None,
    source: str = "texts",
    **options: Any,
) -> dict[str, Manifest]:
    """Tokenise texts and write them as ``x`` (int32 ``(N, length)`` ids) and ``y`` (int64).

    The vocabulary and the automatic length are chosen from the training texts only
    (after the split) and stored, with the classes, the tokenizer settings and the padding
    id (``pad_id``), in the metadata of both manifests; each split's manifest also holds
    its statistics (``stats``: class counts, token lengths, unknown-token rate; see
    :mod:`mpidl.data.stats`). The length is ``metadata["length"]``, how it was chosen
    ``metadata["length_choice"]`` (:func:`mpidl.data.text.resolve_length`), and each
    split's ``stats["tokens"]["cut"]`` counts its texts longer than it.

    Args:
        train_texts, train_labels: texts and their label strings.
        test_texts, test_labels: a given test split; otherwise ``test_fraction`` of the
            training texts, chosen with ``seed``.
        vocab_size: the vocabulary size including ``<pad>`` (0) and ``<unk>`` (1).
        min_freq: words rarer than this in the training texts become ``<unk>``.
        length: tokens per sample (longer texts are cut, shorter ones padded with
            ``<pad>``, id 0), or ``"auto"`` (default): chosen from the training texts by
            :func:`mpidl.data.text.choose_length`.
        classes: class names in id order (default: the sorted distinct training labels).
        **options: passed to :func:`write_shards` / :func:`write_split`.
    """
    if len(train_texts) != len(train_labels):
        raise DataError(f"{source}: {len(train_texts)} texts but {len(train_labels)} labels")
    text_mod.check_length(length)
    if test_texts is None and test_fraction > 0:
        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction {test_fraction} must be in [0, 1)")
        order = numpy.random.default_rng(seed).permutation(len(train_texts))
        n_test = int(round(len(order) * test_fraction))
        test_idx, train_idx = numpy.sort(order[:n_test]), numpy.sort(order[n_test:])
        test_texts = [train_texts[i] for i in test_idx]
        test_labels = [train_labels[i] for i in test_idx]
        train_texts = [train_texts[i] for i in train_idx]
        train_labels = [train_labels[i] for i in train_idx]
    train_tokens = [text_mod.tokenize(t) for t in train_texts]
    vocab = text_mod.vocab_from_tokens(train_tokens, vocab_size, min_freq)
    y, classes = text_mod.encode_labels(list(train_labels), classes)
    train_lengths = _token_counts(train_tokens)
    length, choice = text_mod.resolve_length(length, train_lengths)
    x = text_mod.encode_tokens(train_tokens, vocab, length)
    stats = {"train": stats_mod.text_stats(train_lengths, x, y, length, classes)}
    test = None
    if test_texts is not None:
        if test_labels is None or len(test_texts) != len(test_labels):
            raise DataError(f"{source}: the test split needs one label per text")
        try:
            y_test, _ = text_mod.encode_labels(list(test_labels), classes)
        except ValueError as e:
            raise DataError(
                f"{source}: test split: {e} seen in training; pass `classes` to fix the set"
            ) from e
        test_tokens = [text_mod.tokenize(t) for t in test_texts]
        test = {"x": text_mod.encode_tokens(test_tokens, vocab, length), "y": y_test}
        stats["test"] = stats_mod.text_stats(_token_counts(test_tokens), test["x"], y_test,
                                             length, classes)
    metadata = text_metadata(classes, vocab, length, choice, source, options.pop("metadata", {}))
    return write_shards(
        out_dir,
        {"x": x, "y": y},
        test_arrays=test,
        seed=seed,
        labels="y",
        num_classes=len(classes),
        metadata=metadata,
        stats=stats,
        source=source,
        **options,
    )


def text_metadata(classes: Sequence[str], vocab: list[str], length: int,
                  choice: Mapping[str, Any], source: str, extra: Mapping[str, Any]
                  ) -> dict[str, Any]:
    """The metadata both splits of a text dataset carry (what the model and ``predict``
    need to encode a text as the training texts were)."""
    return {"classes": list(classes), "vocab": vocab, "tokenizer": text_mod.TOKENIZER,
            "pad_id": text_mod.PAD_ID, "length": length, "length_choice": dict(choice),
            "source": source, **extra}


def _token_counts(token_lists: Sequence[Sequence[str]]) -> numpy.ndarray:
    return numpy.fromiter(map(len, token_lists), dtype=numpy.int64, count=len(token_lists))
