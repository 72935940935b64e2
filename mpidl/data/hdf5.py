"""``ShardedDataset``: one split of a sharded HDF5 dataset, read by global sample id.

Samples are numbered ``0 .. len(ds) - 1`` across the shards in manifest order. Reads
take *runs* of consecutive ids (what :class:`~mpidl.data.sampler.DistributedSampler`
produces) and issue one read per run and shard, never one per row.

How files are opened, and why:

- lazily, on the first read in the process that reads: an h5py file opened before a
  ``fork`` and used after it breaks (h5py's documentation, PyTorch #11929), so a handle
  opened in another process id is dropped and the file reopened;
- read-only with ``locking=False`` by default: HDF5 >= 1.10 locks files (``flock``) on open,
  which fails on Lustre without ``flock``, GPFS, Cray DVS and read-only mounts (HDF5
  #3311, h5py #1101), and read-only data needs no lock, so many ranks and jobs can read
  one dataset;
- with ``comm``, rank 0 reads the manifest and broadcasts it (no metadata storm on a
  parallel filesystem), and the start-up checks are spread over the ranks and gathered,
  so every rank raises the same error or none.

Reading a shard (copies out of a memory map at the byte offset of contiguous data,
``read_direct`` otherwise) is :mod:`mpidl.data.shard`'s job. A feature small enough for
``cache_bytes`` (the labels, typically) is read whole once and served from memory.

Every problem is a :class:`~mpidl.data.format.DataError` naming the file: missing shard,
size different from the manifest (truncated), not an HDF5 file, a missing dataset, a dtype
or shape different from the manifest, a checksum mismatch (``check("sha256")``), a label
outside ``[0, num_classes)`` or a token id outside the vocabulary
(:mod:`mpidl.data.ranges`; checked on every read, and by
``check("sha256")``). Errors found at start-up are collective (every rank raises the
same one): the values of a feature small enough for ``cache_bytes`` are checked there;
a bad value in a larger feature is found by the read, on the rank that reads it.
"""

from __future__ import annotations

import bisect
import collections
import os
import threading
from typing import Any, Sequence

import numpy

from mpidl.data.description import DatasetDescription
from mpidl.data.format import DataError, Feature, Manifest, parse_manifest, read_manifest
from mpidl.data.ranges import bad_rows, out_of_range, value_ranges
from mpidl.data.sampler import coalesce_runs
from mpidl.data.shard import ShardFile, ShardLayout, verify_checksum
from mpidl.data.splits import check_splits_agree

VERIFY_LEVELS = ("none", "size", "sha256")


def _load_manifest(path: str, comm: Any) -> Manifest:
    # Rank 0 reads the manifest and broadcasts it: no metadata storm of P reads of one
    # small file on a parallel filesystem, and every rank raises the same error or none.
    if comm is None or comm.size == 1:
        return read_manifest(path)
    payload: Any = None
    if comm.rank == 0:
        try:
            payload = ("ok", read_manifest(path).to_json())
        except DataError as e:
            payload = ("error", str(e), e.problems)
        except OSError as e:
            payload = ("error", f"{path}: cannot read the manifest ({e})", [(path, str(e))])
    payload = comm.bcast_obj(payload)
    if payload[0] == "error":
        raise DataError(payload[1], payload[2])
    return parse_manifest(payload[1], path, os.path.join(path, "manifest.json"))


def _default_max_open(shards: int) -> int:
    """Every shard, up to half the file-descriptor limit (an open shard holds one), at
    least 128."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 128
    if limit == getattr(resource, "RLIM_INFINITY", -1):
        return max(128, shards)
    return max(128, min(shards, limit // 2))


class ShardedDataset(DatasetDescription):
    """One split (a directory with ``manifest.json``) of a sharded dataset.

    Its features, classes and vocabulary are those of its
    :class:`~mpidl.data.description.DatasetDescription`.

    Args:
        path: the split directory, e.g. ``data/reviews/train``.
        split: if given, the split sub-directory of ``path`` to open (``"train"``).
        verify: start-up checks: ``"size"`` (default: every shard exists, has the
            manifest's size, opens, and holds the features with the manifest's dtype and
            shape: O(1) per shard; and the labels or token ids, if they fit in
            ``cache_bytes``, lie in range), ``"sha256"`` (also hash every file and check
            every label and token id: reads everything) or ``"none"``.
        locking: HDF5 file locking passed to ``h5py.File`` (``False``, ``True`` or
            ``"best-effort"``; ``None`` leaves it to ``HDF5_USE_FILE_LOCKING``).
        comm: a communicator: if given, the constructor is collective: rank 0 reads the
            manifest and broadcasts it, each rank checks a ``1/size`` share of the shards,
            and every rank raises the same ``DataError`` (or none).
        max_open: the most shard files kept open at once (least recently used closed).
            Default: every shard, up to half the process's file-descriptor limit (an
            open shard of contiguous data holds one descriptor, its map's), at least
            128. Block-shuffled reads visit every shard every few steps: on a 207-shard
            split read past the page cache, 128 open shards reopened a shard on most
            reads, 0.083-0.094 GB/s, against 0.282-0.286 with all open (1 rank, 2 runs
            each; a reopen then went through HDF5). A shard checked once is reopened
            without HDF5 (:class:`~mpidl.data.shard.ShardLayout`). Past the limit, the
            job may raise its soft limit up to the hard one
            (:func:`~mpidl.data.raise_open_file_limit`); the library never does.
        cache_bytes: a feature whose whole size is at most this (labels, typically: 16 MiB
            is 2 million int64 labels) is read whole on first use and kept in memory.

    Raises:
        DataError: the manifest or a shard is missing, corrupt or inconsistent.
    """

    def __init__(
        self,
        path: str,
        *,
        split: str | None = None,
        verify: str = "size",
        locking: bool | str | None = False,
        comm: Any = None,
        max_open: int | None = None,
        cache_bytes: int = 16 << 20,
    ):
        if verify not in VERIFY_LEVELS:
            raise ValueError(f"verify {verify!r} is not one of {VERIFY_LEVELS}")
        self.path = os.path.join(path, split) if split else path
        self.locking = locking
        self.max_open = max(1, int(max_open)) if max_open is not None else 0
        self.cache_bytes = int(cache_bytes)
        self._memory: dict[str, numpy.ndarray] = {}
        self.manifest = _load_manifest(self.path, comm)
        if not self.max_open:
            self.max_open = _default_max_open(len(self.manifest.shards))
        self.features: dict[str, Feature] = self.manifest.features
        self.ranges = value_ranges(self.manifest)  # labels, token ids: checked on every read
        self.offsets = numpy.concatenate(
            [[0], numpy.cumsum([s.rows for s in self.manifest.shards])]
        ).astype(numpy.int64)
        self._bounds = self.offsets.tolist()  # Python ints: bisect per run beats numpy calls
        self._open: collections.OrderedDict[int, ShardFile] = collections.OrderedDict()
        self._layouts: dict[int, ShardLayout] = {}  # checked once: reopened without HDF5
        self._lock = threading.RLock()
        self._pid = os.getpid()
        if verify != "none":
            self.check(verify, comm=comm)

    # -- description --------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_samples(self) -> int:
        return len(self)

    def shard_path(self, index: int) -> str:
        return os.path.join(self.path, self.manifest.shards[index].file)

    def __repr__(self) -> str:
        feats = ", ".join(f"{n}: {f.dtype.str}{list(f.shape)}" for n, f in self.features.items())
        shards = len(self.manifest.shards)
        return f"ShardedDataset({self.path!r}, {len(self)} samples, {shards} shards, {feats})"

    # -- opening and checking -----------------------------------------------------------
    def _open_shard(self, index: int, keep_hdf5: bool = False) -> ShardFile:
        h = ShardFile(self.shard_path(index), self.manifest.shards[index], self.manifest,
                      self.locking, layout=self._layouts.get(index), keep_hdf5=keep_hdf5)
        self._layouts[index] = h.layout
        return h

    def _handle(self, index: int) -> ShardFile:
        with self._lock:
            h = self._open.get(index)
            if h is not None:
                if len(self._open) >= self.max_open:  # LRU order matters only when full
                    self._open.move_to_end(index)
                return h
            if os.getpid() != self._pid:  # forked: the parent's handles are not ours to use
                self._open.clear()
                self._pid = os.getpid()
            h = self._open_shard(index)
            self._open[index] = h
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)[1].close()
            return h

    def _cached(self, feat: Feature) -> numpy.ndarray | None:
        """The whole feature in memory if it is at most ``cache_bytes`` (labels, typically).

        Tiny rows cost a system call per run like big ones; reading a small feature whole,
        once, removes those calls and lets its labels be range-checked once.
        """
        arr = self._memory.get(feat.name)
        if arr is not None or not self._cacheable(feat):
            return arr
        arr = numpy.empty((len(self), *feat.shape), dtype=feat.dtype)
        pieces = {
            i: [(0, s.rows, int(self.offsets[i]))]
            for i, s in enumerate(self.manifest.shards)
            if s.rows
        }
        flat = arr.reshape(-1).view(numpy.uint8)
        for shard, rows in pieces.items():
            self._handle(shard).read(feat.name, rows, arr, flat, feat.row_bytes)
        if feat.name in self.ranges:
            self._check_batch_range(feat.name, arr, pieces)
        self._memory[feat.name] = arr
        return arr

    def _cacheable(self, feat: Feature) -> bool:
        return 0 < feat.row_bytes * len(self) <= self.cache_bytes

    def _check_shard(self, index: int, level: str) -> None:
        path, shard = self.shard_path(index), self.manifest.shards[index]
        if level == "sha256" and os.path.isfile(path) and os.path.getsize(path) == shard.bytes:
            verify_checksum(path, shard)
        h = self._open_shard(index, keep_hdf5=True)
        try:
            # Values of a feature small enough to cache are checked here, where the
            # check is collective: the first batch would read all of them anyway.
            ranged = [n for n in self.ranges
                      if level == "sha256" or self._cacheable(self.features[n])]
            for name in ranged:
                # in blocks of about 16 MiB: a shard's token ids can be its whole size
                step = max(1, (16 << 20) // max(1, self.features[name].row_bytes))
                for row in range(0, shard.rows, step):
                    self._check_range(name, h.dsets[name][row : row + step], index, row)
        finally:
            h.close()

    def check(self, level: str = "size", comm: Any = None) -> None:
        """Check the shards against the manifest; raise one ``DataError`` listing every bad file.

        Collective when ``comm`` is given: rank ``r`` checks shards ``r, r + size, ...``
        and the problems are gathered, so every rank raises the same error or none.
        """
        if level not in VERIFY_LEVELS:
            raise ValueError(f"level {level!r} is not one of {VERIFY_LEVELS}")
        rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
        problems: list[tuple[str, str]] = []
        messages: list[str] = []
        if level != "none":
            for i in range(rank, len(self.manifest.shards), size):
                try:
                    self._check_shard(i, level)
                except DataError as e:
                    messages.append(str(e))
                    problems.extend(e.problems or [(self.shard_path(i), str(e))])
        if comm is not None and size > 1:
            gathered = comm.allgather_obj((messages, problems))
            messages = [m for ms, _ in gathered for m in ms]
            problems = [p for _, ps in gathered for p in ps]
        if messages:
            head = (
                f"dataset {self.path}: {len(messages)} bad shard file(s):\n  "
                if len(messages) > 1
                else ""
            )
            raise DataError(head + "\n  ".join(messages), problems)

    def _check_range(self, name: str, values: numpy.ndarray, shard: int, first_row: int) -> None:
        """Raise DataError if a value of ``name`` read from ``shard`` (its rows from
        ``first_row`` on) is outside the feature's range."""
        r = self.ranges[name]
        if not out_of_range(values, r.limit):
            return
        bad = bad_rows(values, r.limit)
        row, path = first_row + int(bad[0]), self.shard_path(shard)
        sample = values[bad[0]].reshape(-1)
        value = int(sample[bad_rows(sample, r.limit)[0]])
        raise DataError(
            f"{path}: {r.what} {value} at row {row} is outside [0, {r.limit}) ({bad.size} bad "
            f"row{'s' * (bad.size > 1)} of {name!r} in this read); split "
            f"{self.manifest.split!r}: {r.why}. "
            "The shard does not match its manifest: rewrite the dataset with `mpidl shard` "
            "(`mpidl shard --verify DIR` lists every bad shard)",
            [(path, f"{r.what} out of range")],
        )

    # -- reading ------------------------------------------------------------------------
    def read_runs(
        self, feature: str, runs: numpy.ndarray, out: numpy.ndarray | None = None
    ) -> numpy.ndarray:
        """Read the samples of ``runs`` (``(k, 2)`` ``[start, stop)`` id rows), in order.

        Args:
            feature: the dataset name, e.g. ``"x"``.
            runs: runs of consecutive global ids, as from ``sampler.runs(step)``.
            out: a C-contiguous array of shape ``(n, *shape)`` and the feature's dtype
                to read into; allocated when None.

        Returns:
            ``out``: row ``i`` is the ``i``-th id of the concatenated runs.
        """
        return self.read_batch((feature,), runs, None if out is None else (out,))[0]

    def read_batch(
        self,
        features: Sequence[str],
        runs: numpy.ndarray | list[list[int]],
        out: Sequence[numpy.ndarray] | None = None,
    ) -> list[numpy.ndarray]:
        """:meth:`read_runs` for several features at once (the runs are split by shard once).

        ``runs`` may also be a list of ``[start, stop]`` pairs, as
        :meth:`~mpidl.data.DistributedSampler.runs_between` gives them.
        """
        feats = []
        for name in features:
            if name not in self.features:
                raise KeyError(f"no feature {name!r} in {self.path}; it has {list(self.features)}")
            feats.append(self.features[name])
        pairs = runs if isinstance(runs, list) else \
            numpy.asarray(runs, numpy.int64).reshape(-1, 2).tolist()
        pieces, pos = self._pieces(pairs)
        if out is not None:
            for f, a in zip(feats, out):
                if a.shape != (pos, *f.shape) or a.dtype != f.dtype or not a.flags.c_contiguous:
                    raise ValueError(
                        f"out array for {f.name!r} must be C-contiguous {f.dtype} of shape "
                        f"{(pos, *f.shape)}, got {a.dtype} {a.shape}"
                    )
        arrays: list[numpy.ndarray] = []
        disk: list[tuple[Feature, numpy.ndarray, numpy.ndarray]] = []  # read from the shards
        with self._lock:
            for i, f in enumerate(feats):
                memory = self._cached(f)
                if memory is not None:
                    part = [memory[a:b] for a, b in pairs]
                    if out is not None:
                        arrays.append(numpy.concatenate(part, out=out[i]) if part else out[i])
                    elif len(part) == 1:
                        arrays.append(part[0].copy())
                    else:  # several runs, or none (a rank's empty last step)
                        arrays.append(numpy.concatenate(part) if part else memory[:0].copy())
                    continue
                a = numpy.empty((pos, *f.shape), dtype=f.dtype) if out is None else out[i]
                arrays.append(a)
                if f.row_bytes and pos:
                    disk.append((f, a, a.reshape(-1).view(numpy.uint8)))
            if disk:
                for shard, rows in pieces.items():
                    # The handle right before its reads, and no other shard opened while
                    # they run: opening a shard may close the least recently used one
                    # (max_open), and a closed handle's file descriptor can already belong
                    # to another shard's file.
                    handle = self._handle(shard)
                    for f, a, flat in disk:
                        handle.read(f.name, rows, a, flat, f.row_bytes)
                for f, a, _ in disk:
                    if f.name in self.ranges:
                        self._check_batch_range(f.name, a, pieces)
        return arrays

    def _pieces(self, pairs: list[list[int]]) -> tuple[dict[int, list[tuple[int, int, int]]],
                                                       int]:
        """The runs ``pairs`` cut at shard bounds: shard -> [(first row in the shard, rows,
        position in the batch)], and the batch's rows."""
        bounds = self._bounds
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        pos = 0
        for start, stop in pairs:
            if start < 0 or stop > bounds[-1] or stop < start:
                raise IndexError(f"run [{start}, {stop}) is outside [0, {bounds[-1]}) or reversed")
            while start < stop:
                shard = bisect.bisect_right(bounds, start) - 1
                end = min(stop, bounds[shard + 1])
                rows = pieces.get(shard)
                if rows is None:
                    rows = pieces[shard] = []
                rows.append((start - bounds[shard], end - start, pos))
                pos += end - start
                start = end
        return pieces, pos

    def will_read(self, features: Sequence[str], runs: list[list[int]]) -> None:
        """Advise the kernel that ``runs`` of ``features`` are read next (see
        :meth:`ShardFile.advise <mpidl.data.shard.ShardFile.advise>`): their pages are
        fetched from disk in the background, many at once, instead of one fault at a time
        when the copy reaches them. Features served from memory are left out."""
        disk = [self.features[f] for f in features
                if self.features[f].row_bytes and not self._cacheable(self.features[f])]
        if not disk or not runs:
            return
        pieces, _ = self._pieces(runs)
        with self._lock:
            for shard, rows in pieces.items():
                handle = self._handle(shard)
                for f in disk:
                    handle.advise(f.name, rows, f.row_bytes)

    def _check_batch_range(
        self, name: str, values: numpy.ndarray, pieces: dict[int, list[tuple[int, int, int]]]
    ) -> None:
        limit = self.ranges[name].limit
        if not out_of_range(values, limit):  # one cheap test per batch; locate only if bad
            return
        i = int(bad_rows(values, limit)[0])
        for shard, rows in pieces.items():
            for row, n, at in rows:
                if at <= i < at + n:
                    self._check_range(name, values[i : i + 1], shard, row + i - at)

    def read(self, feature: str, ids: Sequence[int] | numpy.ndarray) -> numpy.ndarray:
        """Read the samples ``ids`` (any order, repeats allowed) of one feature."""
        ids = numpy.asarray(ids, dtype=numpy.int64).reshape(-1)
        return self.read_runs(feature, coalesce_runs(ids, ids + 1))

    def close(self) -> None:
        """Close every open shard (reads reopen them)."""
        with self._lock:
            while self._open:
                self._open.popitem()[1].close()

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for process pools: handles never travel, the new process reopens.
        state = self.__dict__.copy()
        state["_open"], state["_lock"], state["_memory"] = collections.OrderedDict(), None, {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._pid = -1

    def __del__(self) -> None:
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.close()
        except Exception:
            pass


def split_dirs(path: str) -> list[str]:
    """The split directories at ``path``: itself if it holds a manifest, else its
    ``train``/``test``/... sub-directories that do (sorted)."""
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"{path}: no such dataset directory")
    subs = sorted(
        os.path.join(path, d)
        for d in os.listdir(path)
        if os.path.isfile(os.path.join(path, d, "manifest.json"))
    )
    if not subs:
        raise DataError(f"{path}: no manifest.json here or in a sub-directory: not a dataset")
    return subs


def verify_dataset(path: str, level: str = "sha256", comm: Any = None) -> list[ShardedDataset]:
    """Check every split under ``path`` (the ``mpidl shard --verify`` check).

    ``"sha256"`` hashes every shard and checks every label, besides the sizes, datasets,
    dtypes and shapes; and the splits must agree with ``train`` (features, vocabulary,
    classes: :func:`~mpidl.data.splits.check_splits_agree`). Collective when ``comm`` is
    given: each rank hashes a share.

    Raises:
        DataError: listing every bad file of every bad split.
    """
    good, problems = [], []
    # train first: the split the others must agree with
    dirs = sorted(split_dirs(path), key=lambda d: os.path.basename(d) != "train")
    for d in dirs:
        try:
            good.append(ShardedDataset(d, verify=level, comm=comm))
        except DataError as e:  # the other splits are still checked and named
            problems.append(str(e))
    try:
        check_splits_agree({ds.path: ds.manifest for ds in good})
    except DataError as e:
        problems.append(str(e))
    if problems:
        raise DataError("\n".join(problems))
    return good
