"""The splits of one dataset agree: what a model trained on one split assumes of another.

A model trained on ``train`` reads ``test`` through the same input layer and scores it
with the same output layer, so the two must agree on:

- the features: the same names, each with the same dtype and per-sample shape;
- the labels: the same label feature and the same number of classes, and the same
  class names in the same order (label 1 must mean the same class);
- the vocabulary (index = token id): token 17 must be the same word;
- the padding token id: the model leaves out the one it was built with.

A test split written on its own (another vocabulary, a class more) otherwise trains
without complaint and reports a wrong accuracy. :func:`check_splits_agree` is the one
rule; the trainer and ``mpidl shard --verify`` both call it. Storage (layout,
compression), sample counts and free-form metadata may differ.
"""

from __future__ import annotations

from typing import Any, Mapping

from mpidl.data.format import DataError, Manifest

_FIX = "re-shard both splits together with `mpidl shard`"


def _vocabulary(vocab: list[Any], ref_vocab: list[Any], ref: str) -> str | None:
    if vocab == ref_vocab:
        return None
    at = next((i for i, (a, b) in enumerate(zip(vocab, ref_vocab)) if a != b),
              min(len(vocab), len(ref_vocab)))

    def word(v: list[Any]) -> str:
        return repr(v[at]) if at < len(v) else "none"

    return (f"vocabulary differs from {ref}'s ({len(vocab)} vs {len(ref_vocab)} words, "
            f"first difference at id {at}: {word(vocab)} vs {word(ref_vocab)})")


def _labels(labels: dict[str, Any]) -> str:
    return f"labels in {labels['feature']!r}" if labels else "no labels"


def _differences(m: Manifest, ref_m: Manifest, ref: str) -> list[str]:
    """What ``m`` does differently from ``ref_m`` (the split at ``ref``), one item each."""
    out = []
    if set(m.features) != set(ref_m.features):
        out.append(f"features {sorted(m.features)} differ from {ref}'s {sorted(ref_m.features)}")
    for name in m.features.keys() & ref_m.features.keys():
        f, g = m.features[name], ref_m.features[name]
        if f.dtype != g.dtype:
            out.append(f"feature {name!r} has dtype {f.dtype.str}, {ref} has {g.dtype.str}")
        if f.shape != g.shape:
            out.append(f"feature {name!r} has per-sample shape {f.shape}, {ref} has {g.shape}")
    labels, ref_labels = m.labels or {}, ref_m.labels or {}
    if labels.get("feature") != ref_labels.get("feature"):
        out.append(f"has {_labels(labels)}, {ref} has {_labels(ref_labels)}")
    elif labels.get("num_classes") != ref_labels.get("num_classes"):
        out.append(f"{labels['num_classes']} classes, {ref} has {ref_labels['num_classes']}")
    classes, ref_classes = m.metadata.get("classes"), ref_m.metadata.get("classes")
    if classes != ref_classes:
        out.append(f"class names {classes} differ from {ref}'s {ref_classes}")
    vocab, ref_vocab = m.metadata.get("vocab"), ref_m.metadata.get("vocab")
    if vocab is None or ref_vocab is None:
        if vocab is not ref_vocab:
            out.append(f"has {'no' if vocab is None else 'a'} vocabulary, {ref} has "
                       f"{'none' if ref_vocab is None else 'one'}")
    else:
        out.extend(filter(None, [_vocabulary(list(vocab), list(ref_vocab), ref)]))
    if m.pad_id != ref_m.pad_id:
        out.append(f"padding token id {m.pad_id} differs from {ref}'s {ref_m.pad_id}")
    return out


def check_splits_agree(splits: Mapping[str, Manifest]) -> None:
    """Raise one ``DataError`` if a split disagrees with the first (the reference, ``train``).

    Args:
        splits: split directory -> its manifest, the reference first, e.g.
            ``{"data/imdb/train": train.manifest, "data/imdb/test": test.manifest}``.

    Raises:
        DataError: naming each split that differs and each field, e.g. ``data/imdb/test:
            vocabulary differs from data/imdb/train's (20000 vs 19998 words, first
            difference at id 17: 'good' vs 'bad')``, and the fix.
    """
    items = list(splits.items())
    if len(items) < 2:
        return
    ref, ref_m = items[0]
    problems = [(path, p) for path, m in items[1:] for p in _differences(m, ref_m, ref)]
    if problems:
        lines = [f"{path}: {p}" for path, p in problems]
        raise DataError("\n".join(lines) + f"; {_FIX}", problems)
