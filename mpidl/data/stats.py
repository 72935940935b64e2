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
from mpidl.data.text import UNK_ID, covering_counts

PERCENTILES = (50, 90, 95, 99)
# A split lists the counts of at most this many classes (the most frequent ones, in id
# order): a manifest is read by every run, and 2**24 classes would make it ~300 MiB.
MAX_LISTED_CLASSES = 1024
_BLOCK = 1 << 16  # values per block: 256 KiB of float32, in L2 cache for the few passes
# Per-column statistics are stored for features of at most this many values per sample:
# 2 x 4,096 numbers are ~170 KB of manifest, read by every run; past that (volumes,
# large images) a per-position scale is not what a model wants anyway.
MAX_COLUMNS = 4096


def _class_counts(counts: numpy.ndarray, num_classes: int,
                  classes: Sequence[str] | None) -> dict[str, Any]:
    counts = numpy.concatenate([counts, numpy.zeros(max(0, num_classes - len(counts)),
                                                    numpy.int64)])
    names = list(classes) if classes is not None and len(classes) == num_classes \
        else [str(i) for i in range(num_classes)]
    ids = numpy.arange(num_classes)
    out: dict[str, Any] = {}
    if num_classes > MAX_LISTED_CLASSES:
        ids = numpy.sort(numpy.argsort(-counts, kind="stable")[:MAX_LISTED_CLASSES])
        out["classes_omitted"] = num_classes - len(ids)
    out["classes"] = {names[i]: int(counts[i]) for i in ids}
    return out


def feature_moments(a: numpy.ndarray) -> dict[str, Any]:
    """What :func:`feature_stats` needs of ``a``, in a form parts of a split merge from
    (:func:`merge_moments`): count, mean and sum of squared deviations of the finite
    values (float64), their range, and the NaN/inf counts.

    One pass in blocks (the module docstring has the cost); the blocks are combined
    with the same pairwise update as ranks' parts are (Chan et al.).
    """
    flat = numpy.ascontiguousarray(a).reshape(-1)
    if flat.dtype.kind == "b":
        flat = flat.view(numpy.uint8)
    floating, complex_ = flat.dtype.kind == "f", flat.dtype.kind == "c"
    out = {"n": 0, "mean": 0.0, "m2": 0.0, "min": None, "max": None, "nan": 0, "inf": 0,
           "floating": floating}
    for start in range(0, flat.size, _BLOCK):
        b = flat[start : start + _BLOCK]
        if floating or complex_:
            finite = numpy.isfinite(b)
            if not finite.all():
                bad_nan = int(numpy.count_nonzero(numpy.isnan(b)))
                out["nan"] += bad_nan
                out["inf"] += int(b.size - numpy.count_nonzero(finite)) - bad_nan
                b = b[finite]
        if complex_ or not b.size:  # complex values have no order: counts only
            continue
        py = float if floating else int
        block = {"n": int(b.size), "mean": float(b.mean(dtype=numpy.float64)),
                 "m2": float(b.var(dtype=numpy.float64)) * b.size,
                 "min": py(b.min()), "max": py(b.max()), "nan": 0, "inf": 0}
        out = merge_moments([out, block])
    return out


def merge_moments(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The :func:`feature_moments` of the concatenation of the parts' values, in order.

    Counts, NaN/inf counts, min and max merge exactly; the mean and the squared
    deviations by Chan et al.'s pairwise update in float64, so a split merged from
    several ranks' parts agrees with one process's to rounding (about 1e-15 relative),
    not bit for bit: the blocks' boundaries differ.
    """
    out = dict(parts[0])
    for p in parts[1:]:
        for k in ("nan", "inf"):
            out[k] += p[k]
        if not p["n"]:
            continue
        for k, pick in (("min", min), ("max", max)):
            out[k] = p[k] if out[k] is None else pick(out[k], p[k])
        total = out["n"] + p["n"]
        delta = p["mean"] - out["mean"]
        out["mean"] += delta * p["n"] / total
        out["m2"] += p["m2"] + delta * delta * out["n"] * p["n"] / total
        out["n"] = total
    return out


def _finish_moments(m: Mapping[str, Any]) -> dict[str, Any]:
    n = m["n"]
    return {"min": m["min"], "max": m["max"], "mean": m["mean"] if n else None,
            "std": (m["m2"] / n) ** 0.5 if n else None, "nan": m["nan"], "inf": m["inf"]}


def feature_stats(a: numpy.ndarray) -> dict[str, Any]:
    """Range, mean and standard deviation of the finite values of ``a``; NaN/inf counts."""
    return _finish_moments(feature_moments(a))


def column_moments(a: numpy.ndarray) -> dict[str, numpy.ndarray] | None:
    """Per value position of ``a``'s samples: the count, mean and sum of squared
    deviations of the finite values (float64 arrays), which parts of a split merge from
    (:func:`merge_column_moments`); None where :func:`column_stats` has none."""
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
    count = numpy.where(n > 0, n, 1)
    mean_d = total / count
    return {"n": n, "mean": mean_d + shift,
            "m2": numpy.maximum(squares - total * mean_d, 0.0)}


def merge_column_moments(parts: Sequence[Mapping[str, numpy.ndarray] | None]
                         ) -> dict[str, numpy.ndarray] | None:
    """:func:`column_moments` of the parts' rows together (Chan's update per position);
    parts without rows (None) are left out."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    n, mean, m2 = (numpy.array(parts[0][k], numpy.float64) for k in ("n", "mean", "m2"))
    for p in parts[1:]:
        total = n + p["n"]
        safe = numpy.where(total > 0, total, 1)
        delta = p["mean"] - mean
        mean = numpy.where(p["n"] > 0, mean + delta * p["n"] / safe, mean)
        mean = numpy.where(n > 0, mean, p["mean"])
        m2 = m2 + p["m2"] + numpy.where(total > 0, delta * delta * n * p["n"] / safe, 0.0)
        n = total
    return {"n": n, "mean": mean, "m2": m2}


def _finish_columns(m: Mapping[str, numpy.ndarray] | None) -> dict[str, list] | None:
    if m is None:
        return None
    seen = m["n"] > 0
    std = numpy.sqrt(m["m2"] / numpy.where(seen, m["n"], 1))
    return {"mean": [float(v) if k else None for v, k in zip(m["mean"], seen)],
            "std": [float(v) if k else None for v, k in zip(std, seen)]}


def column_stats(a: numpy.ndarray) -> dict[str, list] | None:
    """Mean and standard deviation of each value position of ``a``'s samples (axis 0),
    over the finite values, in float64; None for non-numeric features, features of more
    than :data:`MAX_COLUMNS` values per sample, or no samples. A position with no finite
    value has mean and std None."""
    return _finish_columns(column_moments(a))


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


def text_part(lengths: numpy.ndarray, x: numpy.ndarray, y: numpy.ndarray, length: int,
              num_classes: int) -> dict[str, Any]:
    """What :func:`merge_text_stats` needs of some texts of a split: their count, class
    counts, a histogram of their token lengths (before cutting) and their stored
    ``<unk>`` tokens; parts of a split (ranks') add up exactly."""
    lengths = numpy.asarray(lengths, numpy.int64)
    return {"samples": int(len(y)),
            "counts": numpy.bincount(numpy.asarray(y, numpy.int64), minlength=num_classes),
            "hist": numpy.bincount(lengths) if len(lengths) else numpy.zeros(1, numpy.int64),
            "unknown": int(numpy.count_nonzero(x == UNK_ID))}


def add_counts(arrays: Sequence[numpy.ndarray]) -> numpy.ndarray:
    """The sum of count arrays (histograms, class counts) of different lengths."""
    out = numpy.zeros(max(len(a) for a in arrays), numpy.int64)
    for a in arrays:
        out[: len(a)] += a
    return out


def merge_text_stats(parts: Sequence[Mapping[str, Any]], length: int,
                     classes: Sequence[str]) -> dict[str, Any]:
    """The ``metadata["stats"]`` of a text split from its parts' :func:`text_part`.

    Every number is a sum of the parts' (counts, histograms), so the result is exactly
    one process's: the percentiles are read off the summed length histogram.
    """
    hist = add_counts([p["hist"] for p in parts])
    samples = sum(p["samples"] for p in parts)
    values = numpy.arange(len(hist))
    stored = int((numpy.minimum(values, length) * hist).sum())
    unknown = sum(p["unknown"] for p in parts)
    nonzero = numpy.flatnonzero(hist)
    tokens: dict[str, Any] = {f"p{q}": covering_counts(hist, q) if samples else None
                              for q in PERCENTILES}
    tokens.update(
        max=int(nonzero[-1]) if samples else None,
        mean=float(int((values * hist).sum()) / samples) if samples else None,
        empty=int(hist[0]),
        cut=int(hist[length + 1 :].sum()),
        stored=stored,
        unknown=unknown,
        unk_rate=unknown / stored if stored else 0.0,
    )
    counts = add_counts([p["counts"] for p in parts]) if parts else numpy.zeros(0, numpy.int64)
    return {"samples": samples, **_class_counts(counts, len(classes), classes),
            "tokens": tokens}


def text_stats(lengths: numpy.ndarray, x: numpy.ndarray, y: numpy.ndarray, length: int,
               classes: Sequence[str]) -> dict[str, Any]:
    """The ``metadata["stats"]`` of a text split: samples, class counts, token statistics."""
    return merge_text_stats([text_part(lengths, x, y, length, len(classes))], length, classes)


def array_part(arrays: Mapping[str, numpy.ndarray], labels: str | None,
               num_classes: int | None) -> dict[str, Any]:
    """What :func:`merge_array_stats` needs of some rows of a split: their count, class
    counts and each other feature's :func:`feature_moments` and :func:`column_moments`."""
    n = len(next(iter(arrays.values()))) if arrays else 0
    counts = None
    if labels is not None and num_classes is not None:
        counts = numpy.bincount(numpy.asarray(arrays[labels], numpy.int64),
                                minlength=num_classes)
    return {"samples": int(n), "counts": counts,
            "features": {k: (feature_moments(v), column_moments(v))
                         for k, v in arrays.items() if k != labels}}


def merge_array_stats(parts: Sequence[Mapping[str, Any]], labels: str | None,
                      num_classes: int | None, classes: Sequence[str] | None
                      ) -> dict[str, Any]:
    """The ``metadata["stats"]`` of an array split from its parts' :func:`array_part`:
    samples and class counts are sums (exact); feature statistics merge as
    :func:`merge_moments` says (exact but for the mean and std's last bits)."""
    out: dict[str, Any] = {"samples": sum(p["samples"] for p in parts)}
    if labels is not None and num_classes is not None:
        out.update(_class_counts(add_counts([p["counts"] for p in parts]), num_classes, classes))
    out["features"] = {}
    for k in parts[0]["features"]:
        out["features"][k] = _finish_moments(merge_moments([p["features"][k][0] for p in parts]))
        columns = _finish_columns(merge_column_moments([p["features"][k][1] for p in parts]))
        if columns is not None:
            out["features"][k]["columns"] = columns
    return out


def array_stats(arrays: Mapping[str, numpy.ndarray], labels: str | None,
                num_classes: int | None, classes: Sequence[str] | None) -> dict[str, Any]:
    """The ``metadata["stats"]`` of an array split: samples, class counts (with a label
    feature), and :func:`feature_stats` of every other feature."""
    return merge_array_stats([array_part(arrays, labels, num_classes)], labels, num_classes,
                             classes)


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
