"""Datasets for tests: damage a written one the way a hand-edited or corrupted one looks,
or take its test rows as a user would give them to ``mpidl predict``.

``edit_manifest`` changes a field of a split's manifest; after a test changed a shard's
contents, ``resync_shard`` makes the manifest's size and checksum of that shard match the
file again, so that only the contents differ from what the manifest promises (what a
writer bug, or a careful forger, would leave). Neither is collective: on several ranks,
let rank 0 edit and then ``comm.barrier()``. ``write_test_rows`` writes a test split's
inputs to an ``.npz``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable


def edit_manifest(split: str | os.PathLike, change: Callable[[dict[str, Any]], Any]) -> None:
    """Apply ``change`` to the decoded ``manifest.json`` of ``split`` and write it back."""
    path = os.path.join(split, "manifest.json")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    change(manifest)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def resync_shard(split: str | os.PathLike, index: int) -> str:
    """Set the manifest's ``bytes`` and ``sha256`` of shard ``index`` to the file's own;
    returns the shard's path."""
    from mpidl.data.format import sha256_file

    paths = []

    def update(manifest: dict[str, Any]) -> None:
        entry = manifest["shards"][index]
        paths.append(os.path.join(split, entry["file"]))
        entry.update(bytes=os.path.getsize(paths[0]), sha256=sha256_file(paths[0]))

    edit_manifest(split, update)
    return paths[0]


def write_test_rows(data_dir: str | os.PathLike, path: str | os.PathLike) -> tuple[Any, Any]:
    """Write the inputs ``x`` of ``data_dir``'s test split, in order, to the ``.npz`` at
    ``path`` (what ``mpidl predict`` reads); returns the split and its sample ids, to
    read the truth from (``split.read("y", ids)``)."""
    import numpy

    from mpidl.data import ShardedDataset

    test = ShardedDataset(os.path.join(data_dir, "test"))
    ids = numpy.arange(len(test))
    numpy.savez(path, x=test.read("x", ids))
    return test, ids


def sample_multiset(split: str | os.PathLike) -> list[bytes]:
    """A split's samples as a sorted list of byte strings (every feature of a row, in
    feature-name order): what two datasets that differ only in order share."""
    import numpy

    from mpidl.data import ShardedDataset

    ds = ShardedDataset(str(split), verify="sha256")
    try:
        ids = numpy.arange(len(ds))
        cols = [ds.read(f, ids).reshape(len(ds), -1) for f in sorted(ds.features)]
    finally:
        ds.close()
    return sorted(b"".join(c[i].tobytes() for c in cols) for i in range(len(ids)))


def dataset_differences(got: str | os.PathLike, want: str | os.PathLike,
                        rel: float = 1e-12) -> list[str]:
    """How the dataset at ``got`` differs from the one at ``want``, ignoring sample order
    and shard boundaries: per split, the sample multiset, features, labels, metadata
    (vocabulary, classes, length, ...) and statistics: exactly, except a feature's mean
    and std and its columns', which may differ by ``rel`` (merged from ranks' parts in
    another order: :func:`mpidl.data.stats.merge_moments`). ``[]`` when the same."""
    import numpy

    from mpidl.data import read_manifest

    out: list[str] = []
    splits = sorted(d for d in os.listdir(want) if not d.startswith("."))
    if sorted(d for d in os.listdir(got) if not d.startswith(".")) != splits:
        return [f"{got} holds {sorted(os.listdir(got))}, {want} {splits}"]
    for split in splits:
        a, b = read_manifest(os.path.join(got, split)), read_manifest(os.path.join(want, split))
        if sample_multiset(os.path.join(got, split)) != sample_multiset(os.path.join(want, split)):
            out.append(f"{split}: the samples differ")
        if a.labels != b.labels or a.features != b.features:
            out.append(f"{split}: labels/features {a.labels} {a.features} vs {b.labels} "
                       f"{b.features}")
        meta_a, meta_b = dict(a.metadata), dict(b.metadata)
        stats_a, stats_b = dict(meta_a.pop("stats")), dict(meta_b.pop("stats"))
        if meta_a != meta_b:
            out.append(f"{split}: metadata differs: "
                       f"{sorted(k for k in meta_b if meta_a.get(k) != meta_b[k])}")
        fa, fb = stats_a.pop("features", {}), stats_b.pop("features", {})
        if stats_a != stats_b:  # samples, class counts, token statistics: exact
            out.append(f"{split}: stats differ: {stats_a} vs {stats_b}")
        for k in fb:
            for field in ("min", "max", "nan", "inf"):
                if fa.get(k, {}).get(field) != fb[k][field]:
                    out.append(f"{split}: {k} {field} {fa.get(k, {}).get(field)} vs "
                               f"{fb[k][field]}")
            for field in ("mean", "std"):
                x, y = fa.get(k, {}).get(field), fb[k][field]
                if (x is None) != (y is None) or y is not None and abs(x - y) > rel * abs(y):
                    out.append(f"{split}: {k} {field} {x} vs {y}")
            ca, cb = fa.get(k, {}).get("columns"), fb[k].get("columns")
            if (ca is None) != (cb is None) or cb is not None and not all(
                    numpy.allclose(numpy.array(ca[f], float), numpy.array(cb[f], float),
                                   rtol=rel, atol=0, equal_nan=True) for f in ("mean", "std")):
                out.append(f"{split}: {k} columns differ")
    return out


def sharding_inputs(root: str | os.PathLike, sentences: str | os.PathLike,
                    lines: int = 300) -> dict[str, list[str]]:
    """Write one input of each kind ``mpidl shard`` converts in parallel into ``root``,
    from the first ``lines`` labelled sentences of the TSV ``sentences``; return each
    kind's ``mpidl shard`` options (without OUT_DIR).

    ``csv``: a quoted CSV in which every 7th text holds a newline, a comma and doubled
    quotes (a cut at a newline inside quotes would split a record); ``folder``: the
    ``train/{pos,neg}``, ``test/{pos,neg}`` layout; ``npz``: 157 rows of 5 float32
    features of different scales (one NaN) and 4 classes; ``table``: a numeric CSV of
    131 rows, 2 feature columns and a class-name column; ``h5``: an HDF5 file with given
    ``train`` (97 rows) and ``test`` (41) groups of float64 ``(3, 2)`` samples and int32
    labels.
    """
    import csv

    import numpy

    root = os.fspath(root)
    with open(sentences, encoding="utf-8") as f:
        rows = [line.rstrip("\n").rsplit("\t", 1) for line in f][:lines]
    with open(os.path.join(root, "reviews.csv"), "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["text", "label"])
        for i, (text, label) in enumerate(rows):
            if i % 7 == 0:
                text += '\nsecond line, with "quotes"'
            out.writerow([text, "pos" if label == "1" else "neg"])
    cut = 2 * len(rows) // 3
    for split, part in (("train", rows[:cut]), ("test", rows[cut:])):
        for i, (text, label) in enumerate(part):
            d = os.path.join(root, "folder", split, "pos" if label == "1" else "neg")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{i:04d}.txt"), "w", encoding="utf-8") as f:
                f.write(text)
    rng = numpy.random.default_rng(3)
    x = (rng.normal(size=(157, 5)) * [1, 10, 100, 1e3, 1e4]).astype(numpy.float32)
    x[3, 2] = numpy.nan
    numpy.savez(os.path.join(root, "arrays.npz"), x=x,
                y=rng.integers(0, 4, 157).astype(numpy.int64))
    import h5py

    with h5py.File(os.path.join(root, "arrays.h5"), "w") as f:  # given train and test splits
        for split, n in (("train", 97), ("test", 41)):
            f[f"{split}/x"] = rng.normal(size=(n, 3, 2)).astype(numpy.float64)
            f[f"{split}/y"] = rng.integers(0, 3, n).astype(numpy.int32)
    with open(os.path.join(root, "table.csv"), "w", newline="", encoding="utf-8") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["a", "b", "kind"])
        for i in range(131):
            out.writerow([f"{rng.normal():.6g}", f"{1000 * rng.normal():.6g}",
                          ["red", "green", "blue"][int(rng.integers(0, 3))]])
    return {
        "csv": ["--from-csv", os.path.join(root, "reviews.csv"), "--text-col", "text",
                "--label-col", "label", "--test-fraction", "0.2"],
        "folder": ["--from-folder", os.path.join(root, "folder")],
        "npz": ["--from-npz", os.path.join(root, "arrays.npz"), "--test-fraction", "0.25"],
        "table": ["--from-csv", os.path.join(root, "table.csv"), "--feature-cols", "a,b",
                  "--label-col", "kind"],
        "h5": ["--from-h5", os.path.join(root, "arrays.h5")],
    }
