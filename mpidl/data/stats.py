"""What a split's data is: class counts, token lengths, feature value ranges.

The writer computes these once per split and stores them in the split's manifest as
``metadata["stats"]``; ``mpidl shard`` prints them, and the trainer reads them back
(:func:`class_counts`, :func:`majority`) to warn when one class dominates::

    "stats": {"samples": 2700,
              "classes": {"0": 1347, "1": 1353},          # by class name, in id order
              "tokens": {"p50": 10, "p90": 23, "p95": 26, "p99": 36, "max": 73,
                         "mean": 12.1, "empty": 0,         # texts with no token
                         "cut": 21,                        # texts longer than the length
                         "stored": 32601, "unknown": 0,    # tokens kept; of them <unk>
                         "unk_rate": 0.0}}                 # text datasets
              "features": {"x": {"min": -3.1, "max": 4.2, "mean": 0.01, "std": 1.0,
                                 "nan": 0, "inf": 0,       # array datasets, per feature
                                 "columns": {"mean": [...], "std": [...]}}}}

Token lengths are counted before cutting (``p99`` is the inverted-CDF percentile of
:func:`mpidl.data.text.covering`: 99% of the texts have at most that many tokens); the
unknown-token rate is over the tokens stored (what the model sees). Feature ranges are
over the finite values; NaN and infinite values are counted, not hidden: they are legal
in a dataset, but a model trained on them gets a NaN loss. ``columns`` holds the mean
and standard deviation of each value position of a sample (a CSV's columns; an image's
pixels), over the finite values, for features of at most :data:`MAX_COLUMNS` values per
sample: the train split's are what the ``mlp`` standardises its inputs with, and the
feature models and the regression loss their targets (:func:`column_scale`), so that a
table whose columns are in different units (the wine data: hue about 1, proline about
1,000) trains as well as a standardised one.

Cost: one pass over each feature in blocks of 64 Ki values, each block in cache for its
few reductions: 1M rows x 64 float32 (256 MiB) take 0.12-0.14 s on one core, against
0.27 s for whole-array NumPy calls (``isfinite``, ``min``, ``max``, ``mean``, ``std``),
which also allocate 512 MiB of float64 temporaries; the writer's SHA-256 of the shards
holding those rows takes 0.2 s.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy

from mpidl.data.format import Manifest
from mpidl.data.text import UNK_ID, covering

PERCENTILES = (50, 90, 95, 99)
# A split lists the counts of at most this many classes (the most frequent ones, in id
# order): a manifest is read by every run, and 2**24 classes would make it ~300 MiB.
MAX_LISTED_CLASSES = 1024
_BLOCK = 1 << 16  # values per block: 256 KiB of float32, in L2 cache for the few passes
# Per-column statistics are stored for features of at most this many values per sample:
# 2 x 4,096 numbers are ~170 KB of manifest, read by every run; past that (volumes,
# large images) a per-position scale is not what a model wants anyway.
MAX_COLUMNS = 4096


def _class_counts(y: numpy.ndarray, num_classes: int,
                  classes: Sequence[str] | None) -> dict[str, Any]:
    counts = numpy.bincount(numpy.asarray(y, numpy.int64), minlength=num_classes)
    names = list(classes) if classes is not None and len(classes) == num_classes \
        else [str(i) for i in range(num_classes)]
    ids = numpy.arange(num_classes)
    out: dict[str, Any] = {}
    if num_classes > MAX_LISTED_CLASSES:
        ids = numpy.sort(numpy.argsort(-counts, kind="stable")[:MAX_LISTED_CLASSES])
        out["classes_omitted"] = num_classes - len(ids)
    out["classes"] = {names[i]: int(counts[i]) for i in ids}
    return out


def token_stats(lengths: numpy.ndarray, x: numpy.ndarray, length: int) -> dict[str, Any]:
    """Token-length percentiles (before cutting), cut and empty texts, the ``<unk>`` rate.

    Args:
        lengths: tokens per text, before cutting, ``(N,)``.
        x: the stored token ids, ``(N, length)``.
        length: tokens per sample.
    """
    lengths = numpy.asarray(lengths, numpy.int64)
    stored = int(numpy.minimum(lengths, length).sum())
    unknown = int(numpy.count_nonzero(x == UNK_ID))
    out: dict[str, Any] = {f"p{q}": covering(lengths, q) if len(lengths) else None
                           for q in PERCENTILES}
    out.update(
        max=int(lengths.max()) if len(lengths) else None,
        mean=float(lengths.mean()) if len(lengths) else None,
        empty=int(numpy.count_nonzero(lengths == 0)),
        cut=int(numpy.count_nonzero(lengths > length)),
        stored=stored,
        unknown=unknown,
        unk_rate=unknown / stored if stored else 0.0,
    )
    return out


def feature_stats(a: numpy.ndarray) -> dict[str, Any]:
    """Range, mean and standard deviation of the finite values of ``a``; NaN/inf counts.

    One pass in blocks (the module docstring has the cost); the mean and variance of the
    blocks are combined exactly (Chan et al.'s pairwise update), in float64.
    """
    flat = numpy.ascontiguousarray(a).reshape(-1)
    if flat.dtype.kind == "b":
        flat = flat.view(numpy.uint8)
    floating, complex_ = flat.dtype.kind == "f", flat.dtype.kind == "c"
    lo = hi = None
    n, mean, m2, nan, inf = 0, 0.0, 0.0, 0, 0
    for start in range(0, flat.size, _BLOCK):
        b = flat[start : start + _BLOCK]
        if floating or complex_:
            finite = numpy.isfinite(b)
            if not finite.all():
                bad_nan = int(numpy.count_nonzero(numpy.isnan(b)))
                nan, inf = nan + bad_nan, inf + int(b.size - numpy.count_nonzero(finite)) - bad_nan
                b = b[finite]
        if complex_ or not b.size:  # complex values have no order: counts only
            continue
        b_lo, b_hi = b.min(), b.max()
        lo = b_lo if lo is None else min(lo, b_lo)
        hi = b_hi if hi is None else max(hi, b_hi)
        b_mean = float(b.mean(dtype=numpy.float64))
        b_m2 = float(b.var(dtype=numpy.float64)) * b.size
        total = n + b.size
        delta = b_mean - mean
        mean += delta * b.size / total
        m2 += b_m2 + delta * delta * n * b.size / total
        n = total
    py = float if floating else int
    return {
        "min": None if lo is None else py(lo),
        "max": None if hi is None else py(hi),
        "mean": mean if n else None,
        "std": (m2 / n) ** 0.5 if n else None,
        "nan": nan,
        "inf": inf,
    }


def column_stats(a: numpy.ndarray) -> dict[str, list] | None:
    """Mean and standard deviation of each value position of ``a``'s samples (axis 0),
    over the finite values, in float64; None for non-numeric features, features of more
    than :data:`MAX_COLUMNS` values per sample, or no samples. A position with no finite
    value has mean and std None."""
    if a.dtype.kind not in "biuf" or not len(a):
        return None
    rows = numpy.ascontiguousarray(a).reshape(len(a), -1)
    width = rows.shape[1]
    if not 0 < width <= MAX_COLUMNS:
        return None
    n, total, squares = (numpy.zeros(width) for _ in range(3))
    shift = None  # sums of x - shift (the first finite row's values): no cancellation
    for start in range(0, len(rows), max(1, _BLOCK // width)):
        b = rows[start : start + max(1, _BLOCK // width)].astype(numpy.float64)
        finite = numpy.isfinite(b)
        if shift is None:
            shift = numpy.where(finite, b, 0.0)[0]
        d = numpy.where(finite, b - shift, 0.0)
        n += finite.sum(0)
        total += d.sum(0)
        squares += (d * d).sum(0)
    seen = n > 0
    count = numpy.where(seen, n, 1)
    mean_d = total / count
    std = numpy.sqrt(numpy.maximum(squares / count - mean_d * mean_d, 0.0))
    mean = mean_d + shift
    return {"mean": [float(m) if k else None for m, k in zip(mean, seen)],
            "std": [float(v) if k else None for v, k in zip(std, seen)]}


def column_scale(manifest: Manifest, name: str) -> tuple[list, list] | None:
    """``(mean, std)`` per value position of feature ``name`` of the split ``manifest``
    describes (:func:`column_stats`), or None when the split has none (written before
    mpidl stored them, a text split, or too wide a feature)."""
    stats = manifest.metadata.get("stats")
    feature = stats.get("features", {}).get(name) if isinstance(stats, dict) else None
    columns = feature.get("columns") if isinstance(feature, dict) else None
    if not isinstance(columns, dict) or not {"mean", "std"} <= columns.keys():
        return None
    return list(columns["mean"]), list(columns["std"])


def text_stats(lengths: numpy.ndarray, x: numpy.ndarray, y: numpy.ndarray, length: int,
               classes: Sequence[str]) -> dict[str, Any]:
    """The ``metadata["stats"]`` of a text split: samples, class counts, token statistics."""
    return {"samples": int(len(y)), **_class_counts(y, len(classes), classes),
            "tokens": token_stats(lengths, x, length)}


def array_stats(arrays: Mapping[str, numpy.ndarray], labels: str | None,
                num_classes: int | None, classes: Sequence[str] | None) -> dict[str, Any]:
    """The ``metadata["stats"]`` of an array split: samples, class counts (with a label
    feature), and :func:`feature_stats` of every other feature."""
    n = len(next(iter(arrays.values()))) if arrays else 0
    out: dict[str, Any] = {"samples": int(n)}
    if labels is not None and num_classes is not None:
        out.update(_class_counts(arrays[labels], num_classes, classes))
    out["features"] = {}
    for k, v in arrays.items():
        if k != labels:
            out["features"][k] = feature_stats(v)
            columns = column_stats(v)
            if columns is not None:
                out["features"][k]["columns"] = columns
    return out


def class_counts(manifest: Manifest) -> dict[str, int] | None:
    """Samples per class name (id order) of the split ``manifest`` describes.

    None for a split written before mpidl stored statistics, or without labels. A split
    of more than :data:`MAX_LISTED_CLASSES` classes lists only the most frequent ones.
    """
    stats = manifest.metadata.get("stats")
    counts = stats.get("classes") if isinstance(stats, dict) else None
    return dict(counts) if isinstance(counts, dict) else None


def majority(manifest: Manifest) -> tuple[str, float] | None:
    """The most frequent class of the split and its share of the samples: the accuracy of
    always guessing it, e.g. ``("positive", 0.87)``; None without :func:`class_counts`
    or samples.

    Ties go to the class of the lowest id. The trainer warns from the train split's.
    """
    counts = class_counts(manifest)
    total = manifest.metadata["stats"].get("samples") if counts else None
    if not counts or not total:
        return None
    name = max(counts, key=lambda c: counts[c])  # the first of the largest: the lowest id
    return name, counts[name] / total
