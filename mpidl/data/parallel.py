"""One dataset written by many ranks: ``mpiexec -n P mpidl shard ...``.

Each rank holds a contiguous share of the input, in rank order (files of a folder, a
byte range of a CSV file cut at record boundaries: :mod:`mpidl.data.partition`, rows of
an array or HDF5 file), converts it and writes its own shards; rank 0 writes the
manifests and puts the dataset in place. The result is the dataset one process writes
from the same input and seed:

- **the same samples in each split.** The ranks gather their row counts, so each knows
  its rows' numbers in the whole input, and every rank draws the same permutation of all
  ``N`` rows from ``seed``: the rows held out as the test split are one process's.
- **the same vocabulary, classes, length and statistics**, merged from the ranks' parts:
  word counts, label sets, token-length histograms and class counts add up exactly (so
  the vocabulary, the automatic length and the token percentiles are one process's, bit
  for bit); a feature's min, max and NaN/inf counts merge exactly, its mean and standard
  deviation (and each column's) by Chan et al.'s pairwise update in float64, equal to
  one process's to rounding (:func:`mpidl.data.stats.merge_moments`).
- **the same labels** (class ids from the merged class names).

What differs is the order. One process writes a split in its permutation's order; here
rank ``r`` writes its own rows in that same permutation's order into its own shards, so
the split holds rank 0's rows, then rank 1's, ..., and each rank's last shard may be
short (up to ``P`` short shards instead of one). The sampler shuffles at read time, and
a dataset's shards need not be full.

Memory: every rank holds the permutation of all ``N`` rows and its inverse (16 bytes a
row: 1.6 GB for 100 million rows), besides its own share of the data.

Failures: every step that can fail on one rank (reading its share, a bad label, a write)
ends in an agreement (:func:`agreed`): every rank raises the same error, naming the rank
that failed, or none. Shards go into a new directory beside the dataset that rank 0
creates, and rank 0 moves them in place only after every rank has written all of its
own (:mod:`mpidl.data.publish`): a failure on any rank removes the partial new dataset
and leaves an old one (``--force``) as it was.
"""

from __future__ import annotations

import collections
import os
import shutil
import uuid
from typing import Any, Callable, Mapping, Sequence

import numpy

from mpidl.data import stats as stats_mod
from mpidl.data import text as text_mod
from mpidl.data.format import DataError, Manifest, write_manifest
from mpidl.data.publish import StorageError, install, old_files, stage, storage_error
from mpidl.data.shard_writer import (
    check_options,
    created_now,
    make_manifest,
    shard_rows,
    write_rows,
    writer_info,
)
from mpidl.data.writer import _check_arrays, _check_labels, text_metadata


def agreed(comm: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on every rank; if it raised on any rank, every rank raises
    the error of the lowest rank that failed, its message naming that rank.

    Collective (one ``allgather_obj``). The error keeps its kind: ``StorageError``,
    ``DataError``, ``ValueError``, ``OSError`` (errno and file name kept); anything else
    (a bug) becomes a ``RuntimeError`` on every rank.
    """
    failure, own = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every kind is re-raised below, on every rank
        own = e
        if isinstance(e, DataError):
            kind = "storage" if isinstance(e, StorageError) else "data"
            failure = (kind, str(e), e.problems)
        elif isinstance(e, OSError):
            failure = ("os", e.errno, e.strerror or str(e), e.filename)
        elif isinstance(e, ValueError):
            failure = ("value", str(e))
        else:
            failure = ("other", f"{type(e).__name__}: {e}")
    failures = comm.allgather_obj(failure)
    bad = [(r, f) for r, f in enumerate(failures) if f is not None]
    if not bad:
        return result
    rank, f = bad[0]
    who = f"rank {rank} of {comm.size}: " if comm.size > 1 else ""
    error: Exception
    if f[0] in ("storage", "data"):
        error = (StorageError if f[0] == "storage" else DataError)(who + f[1], f[2])
    elif f[0] == "os":
        error = OSError(f[1], who + f[2], f[3])
    elif f[0] == "value":
        error = ValueError(who + f[1])
    else:
        error = RuntimeError(who + f[1])
    raise error from (own if rank == comm.rank else None)


def _offsets(counts: Sequence[int]) -> list[int]:
    return [int(v) for v in numpy.concatenate([[0], numpy.cumsum(counts)])]


def _order(positions: numpy.ndarray, keep: numpy.ndarray, shuffle: bool) -> numpy.ndarray:
    """The local rows where ``keep`` holds, by their ``positions`` in the permutation
    (``shuffle``) or in input order."""
    idx = numpy.flatnonzero(keep)
    return idx[numpy.argsort(positions[idx], kind="stable")] if shuffle else idx


def _positions(perm: numpy.ndarray, lo: int, hi: int) -> numpy.ndarray:
    """Where rows ``lo .. hi`` of the input stand in ``perm`` (a permutation of all)."""
    inverse = numpy.empty(len(perm), numpy.int64)
    inverse[perm] = numpy.arange(len(perm))
    return inverse[lo:hi]


def _signature(arrays: Mapping[str, numpy.ndarray]) -> dict[str, tuple[str, tuple]]:
    return {k: (v.dtype.str, tuple(v.shape[1:])) for k, v in arrays.items()}


def write_shards_parallel(
    comm: Any,
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
    metadata: Mapping[str, Any] | None = None,
    rows_per_shard: int | None = None,
    compression: str | None = None,
    overwrite: bool = False,
    source: str = "arrays",
) -> dict[str, Manifest]:
    """:func:`mpidl.data.write_shards` from ranks that each hold a share of the rows.

    Collective: every rank of ``comm`` calls it with the same options; ``arrays`` (and
    ``test_arrays``) are this rank's contiguous share of the input's rows, ranks in input
    order, with the same features (names, dtypes, per-sample shapes) on every rank; a
    share may be empty. The module docstring says what equals one process's dataset.

    Returns:
        ``{"train": manifest, "test": manifest}`` on every rank.

    Raises:
        DataError, ValueError, StorageError: on every rank, as :func:`agreed` says.
    """

    label = "y" if labels == "auto" else labels
    # What every rank must pass alike (the collective contract), compared below.
    options = repr((os.path.abspath(out_dir), test_arrays is None, test_fraction, seed,
                    shuffle, labels, num_classes, rows_per_shard, compression, overwrite))

    def local() -> tuple:
        if not 0.0 <= test_fraction < 1.0:
            raise ValueError(f"test_fraction {test_fraction} must be in [0, 1)")
        check_options(rows_per_shard, compression)
        n = _check_arrays(arrays, source)
        m = None
        if test_arrays is not None:
            m = _check_arrays(test_arrays, f"{source} (test split)")
        tops = [int(a[label].max()) for a in (arrays, test_arrays or {})
                if label in a and len(a[label]) and a[label].dtype.kind in "iu"]
        return n, m, _signature(arrays), test_arrays and _signature(test_arrays), \
            max(tops, default=-1), options

    arrays = {k: numpy.asarray(v) for k, v in arrays.items()}
    if test_arrays is not None:
        test_arrays = {k: numpy.asarray(v) for k, v in test_arrays.items()}
    parts = comm.allgather_obj(agreed(comm, local))
    # Every rank decides from the same gathered values: the same error on all, or none.
    differ = [r for r, p in enumerate(parts) if p[5] != parts[0][5]]
    if differ:
        raise ValueError(f"write_shards_parallel: rank {differ[0]} was called with "
                         f"{parts[differ[0]][5]}, rank 0 with {parts[0][5]} (out_dir, a "
                         "given test split, test_fraction, seed, shuffle, labels, num_classes, "
                         "rows_per_shard, compression, overwrite): every rank must pass the "
                         "same")
    features = [p[2] for p in parts]
    if any(f != features[0] for f in features):
        raise DataError(f"{source}: the ranks' shares have different features {features}; "
                        "every rank must read the same input")
    if test_arrays is not None and any(set(p[3] or {}) != set(features[0]) for p in parts):
        raise DataError(f"{source}: the test split has features {sorted(parts[0][3] or {})}, "
                        f"the training split {sorted(features[0])}")
    counts = [p[0] for p in parts]
    starts = _offsets(counts)
    n, lo, hi = starts[-1], starts[comm.rank], starts[comm.rank + 1]
    rng = numpy.random.default_rng(seed)
    perm = rng.permutation(n)
    positions = _positions(perm, lo, hi)
    n_test = int(round(n * test_fraction)) if test_arrays is None and test_fraction > 0 else 0
    orders = {"train": _order(positions, positions < n - n_test, shuffle)}
    if n_test:
        orders["test"] = _order(positions, positions >= n - n_test, shuffle)
    splits = {name: {k: v[idx] for k, v in arrays.items()} for name, idx in orders.items()}
    if test_arrays is not None:
        t_starts = _offsets([p[1] for p in parts])
        t_perm = rng.permutation(t_starts[-1]) if shuffle else numpy.arange(t_starts[-1])
        t_pos = _positions(t_perm, t_starts[comm.rank], t_starts[comm.rank + 1])
        idx = _order(t_pos, numpy.ones(len(t_pos), bool), True)
        splits["test"] = {k: v[idx] for k, v in test_arrays.items()}
    if labels == "auto":
        y = arrays.get("y")
        labels = "y" if y is not None and y.dtype.kind in "iu" and y.ndim == 1 else None
    if labels is not None:
        if num_classes is None:
            num_classes = max(p[4] for p in parts) + 1

        def check() -> None:
            where = f"{source} (the share from input row {lo})"
            _check_labels(arrays, labels, num_classes, where)
            if test_arrays is not None:
                _check_labels(test_arrays, labels, num_classes, f"{where}, test split")

        agreed(comm, check)
    metadata = dict(metadata or {})
    if stats is None:
        gathered = comm.allgather_obj({s: stats_mod.array_part(a, labels, num_classes)
                                       for s, a in splits.items()})
        stats = {s: stats_mod.merge_array_stats([g[s] for g in gathered], labels, num_classes,
                                                metadata.get("classes"))
                 for s in splits}
    return _publish(comm, out_dir, splits, stats, metadata, labels=labels,
                    num_classes=num_classes, rows_per_shard=rows_per_shard,
                    compression=compression, overwrite=overwrite)


def _publish(comm: Any, out_dir: str, splits: Mapping[str, Mapping[str, numpy.ndarray]],
             stats: Mapping[str, Mapping[str, Any]], metadata: Mapping[str, Any], *,
             labels: str | None, num_classes: int | None, rows_per_shard: int | None,
             compression: str | None, overwrite: bool) -> dict[str, Manifest]:
    """Every rank writes its rows of ``splits``; rank 0 the manifests, then the move."""
    storage = check_options(rows_per_shard, compression)
    counts = comm.allgather_obj({s: len(next(iter(a.values()))) for s, a in splits.items()})

    def prepare() -> Any:
        if comm.rank != 0:
            return None
        old = old_files(out_dir, overwrite, ("train", "test"))
        new = stage(out_dir)
        for name in splits:
            os.makedirs(os.path.join(new, name))
        return old, new, uuid.uuid4().hex, writer_info()

    old, new, dataset_id, writer = comm.bcast_obj(agreed(comm, prepare))
    plan = {}
    for name, a in splits.items():
        per = shard_rows(a, rows_per_shard)
        rows = [c[name] for c in counts]
        shards = [-(-r // per) for r in rows]
        plan[name] = (per, _offsets(shards), _offsets(rows))

    def write_mine() -> dict[str, list]:
        out = {}
        for name, a in splits.items():
            per, first_shards, first_rows = plan[name]
            out[name] = write_rows(
                os.path.join(new, name), a, storage, per, split=name,
                dataset_id=f"{dataset_id}-{name}", first_shard=first_shards[comm.rank],
                num_shards=first_shards[-1], first_sample=first_rows[comm.rank],
                writer=writer)
        return out

    try:
        mine = agreed(comm, write_mine)
    except OSError as e:  # a full disk, a quota, a file-size limit: on some rank
        raise storage_error(e, out_dir, new, old) from e
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    everyone = comm.allgather_obj(mine)
    created = comm.bcast_obj(created_now() if comm.rank == 0 else None)
    manifests = {
        name: make_manifest(a, [s for m in everyone for s in m[name]], storage, split=name,
                            dataset_id=f"{dataset_id}-{name}", labels=labels,
                            num_classes=num_classes,
                            metadata={**metadata, "stats": dict(stats[name])}, writer=writer,
                            created=created)
        for name, a in splits.items()
    }

    def commit() -> None:
        if comm.rank != 0:
            return
        try:
            for name, m in manifests.items():
                write_manifest(os.path.join(new, name), m)
        except OSError as e:
            raise storage_error(e, out_dir, new, old) from e
        install(out_dir, new, list(manifests), old)

    agreed(comm, commit)
    return manifests


def write_text_shards_parallel(
    comm: Any,
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
    """:func:`mpidl.data.write_text_shards` from ranks that each hold a share of the texts.

    Collective, as :func:`write_shards_parallel` (its shares and its result). The
    vocabulary comes from the word counts of every rank's training texts, added up; the
    classes (unless given) from the union of their labels; the automatic length from the
    sum of their token-length histograms: each exactly one process's.
    """

    def local_split() -> tuple:
        if len(train_texts) != len(train_labels):
            raise DataError(f"{source}: {len(train_texts)} texts but {len(train_labels)} "
                            "labels")
        if test_texts is not None and (test_labels is None
                                       or len(test_texts) != len(test_labels)):
            raise DataError(f"{source}: the test split needs one label per text")
        text_mod.check_length(length)
        if test_texts is None and test_fraction > 0 and not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test_fraction {test_fraction} must be in [0, 1)")
        return len(train_texts)

    counts = comm.allgather_obj(agreed(comm, local_split))
    if not sum(counts):
        raise DataError(f"{source}: no records (on any of the {comm.size} ranks)")
    train, test = (list(train_texts), list(train_labels)), None
    if test_texts is not None:
        test = (list(test_texts), list(test_labels))
    elif test_fraction > 0:  # one process's split: the same permutation of all texts
        starts = _offsets(counts)
        order = numpy.random.default_rng(seed).permutation(starts[-1])
        held = numpy.zeros(starts[-1], bool)
        held[order[: int(round(starts[-1] * test_fraction))]] = True
        mine = held[starts[comm.rank] : starts[comm.rank + 1]]
        test = tuple([v for v, h in zip(seq, mine) if h] for seq in train)
        train = tuple([v for v, h in zip(seq, mine) if not h] for seq in train)
    train_tokens = [text_mod.tokenize(t) for t in train[0]]
    words: collections.Counter[str] = collections.Counter()
    for tokens in train_tokens:
        words.update(tokens)
    lengths = numpy.fromiter(map(len, train_tokens), numpy.int64, len(train_tokens))
    hist = numpy.bincount(lengths) if len(lengths) else numpy.zeros(1, numpy.int64)
    gathered = comm.allgather_obj((words, set(train[1]), hist))
    total: collections.Counter[str] = collections.Counter()
    for w, _, _ in gathered:
        total.update(w)
    vocab = agreed(comm, text_mod.vocab_from_counts, total, vocab_size, min_freq)
    if classes is None:
        classes = text_mod.default_classes(set().union(*(g[1] for g in gathered)))
    length, choice = text_mod.resolve_length_counts(
        length, stats_mod.add_counts([g[2] for g in gathered]))

    def encode() -> tuple:
        y, _ = text_mod.encode_labels(train[1], classes)
        x = text_mod.encode_tokens(train_tokens, vocab, length)
        out = {"train": ({"x": x, "y": y}, stats_mod.text_part(lengths, x, y, length,
                                                               len(classes)))}
        if test is not None:
            try:
                y_test, _ = text_mod.encode_labels(test[1], classes)
            except ValueError as e:
                raise DataError(f"{source}: test split: {e} seen in training; pass "
                                "`classes` to fix the set") from e
            tokens = [text_mod.tokenize(t) for t in test[0]]
            x_test = text_mod.encode_tokens(tokens, vocab, length)
            test_lengths = numpy.fromiter(map(len, tokens), numpy.int64, len(tokens))
            out["test"] = ({"x": x_test, "y": y_test},
                           stats_mod.text_part(test_lengths, x_test, y_test, length,
                                               len(classes)))
        return out

    encoded = agreed(comm, encode)
    parts = comm.allgather_obj({s: part for s, (_, part) in encoded.items()})
    stats = {s: stats_mod.merge_text_stats([p[s] for p in parts], length, list(classes))
             for s in encoded}
    metadata = text_metadata(classes, vocab, length, choice, source, options.pop("metadata", {}))
    return write_shards_parallel(
        comm, out_dir, encoded["train"][0],
        test_arrays=encoded["test"][0] if "test" in encoded else None,
        seed=seed, labels="y", num_classes=len(classes), metadata=metadata, stats=stats,
        source=source, **options)
