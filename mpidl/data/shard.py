"""One shard file: opened read-only, checked against the manifest, read by row ranges.

``ShardFile`` is what :class:`~mpidl.data.hdf5.ShardedDataset` keeps open per shard: the
h5py file, its datasets, a raw file descriptor, a read-only memory map of the file and
each dataset's byte offset. Contiguous, unfiltered datasets (the default layout) are
read by copying runs out of the map at that offset: no HDF5 call, no system call once
the pages are mapped, and the GIL released during the copy, so the loader's thread
overlaps the training step. Measured on 100-200 KB runs from the page cache: 17 GB/s
from the map against 9.8 GB/s with ``os.preadv`` (whose kernel copy looks the page
cache up page by page), which is what lets the loader match a raw sequential read.
Where a filesystem refuses maps, ``os.preadv`` at the offset reads the same bytes.
Chunked or compressed datasets (no byte offset) use ``read_direct``.

The price of a map: a file that shrinks while mapped would fault (SIGBUS) instead of
reading short, so every read first checks the file's size (one ``fstat``) and a shard
truncated mid-run is a ``DataError`` naming it. Mapped pages count in the process's
resident memory (they are the page cache's, shared, and reclaimable).

File descriptors: once checked, a shard whose features are all contiguous keeps only
its map (which holds one descriptor: CPython's ``mmap`` keeps a duplicate for
``size()``); HDF5's file and the descriptor that made the map are closed. Before this,
an open shard held three (HDF5's, ours and the map's), so a split of more shards than a
third of the descriptor limit could not stay open. Reopening a shard that was checked
once (``ShardLayout``: the file's identity and its datasets' offsets) skips HDF5 when
the file is still the same inode, size and modification time: ``open``, ``fstat``,
``mmap``, measured in benchmarks/README.md against a full open.

Opening checks, at O(1) cost: the file exists and has the manifest's size (a truncated
copy is caught before HDF5 reports a cryptic ``eof`` error), HDF5 opens it, its
attributes name an mpidl shard of this very dataset, and every feature is there with the
manifest's dtype and shape. ``verify_checksum`` hashes the whole file (SHA-256), the only
way to see bytes flipped inside contiguous raw data.

HDF5 file locking: the default ``locking=False`` suits read-only data on parallel
filesystems (see :mod:`mpidl.data.hdf5`). HDF5 refuses to open one file twice in a
process with different locking settings ("file locking flag values don't match"), so
code that opens a shard itself while a dataset holds it open must pass the same value.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, NamedTuple

import numpy

from mpidl.data.format import SHARD_FORMAT, DataError, Manifest, Shard, sha256_file

_CHUNK_CACHE = 8 << 20  # bytes of chunk cache per file: a few chunks, for chunked layouts


class ShardLayout(NamedTuple):
    """What a checked open of a shard learned: the file's identity (device, inode, size,
    modification time in ns) and each feature's byte offset (None: not contiguous)."""

    identity: tuple[int, int, int, int]
    offsets: dict[str, int | None]


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _problem(path: str, problem: str, short: str | None = None) -> DataError:
    return DataError(f"{path}: {problem}", [(path, short or problem)])


class ShardFile:
    """An open, checked shard.

    Args:
        path: the shard file.
        shard: its manifest entry (rows, bytes).
        manifest: the split's manifest (features, dataset id).
        locking: passed to ``h5py.File`` (``None``: HDF5's default / ``HDF5_USE_FILE_LOCKING``).
        layout: what an earlier checked open of this file learned (its ``layout``):
            if the file is still that inode, size and modification time, HDF5 is not
            opened again (a cheap reopen).
        keep_hdf5: keep HDF5's file and ``dsets`` open even when every feature is read
            through the map (for code that reads the datasets with h5py).

    Attributes:
        layout: the file's :class:`ShardLayout`, for a later cheap reopen.

    Raises:
        DataError: missing, wrong size, not HDF5, not a shard of this dataset, a feature
            missing or with another dtype or shape.
    """

    def __init__(
        self, path: str, shard: Shard, manifest: Manifest, locking: bool | str | None = False,
        layout: ShardLayout | None = None, keep_hdf5: bool = False,
    ):
        self.path = path
        self.h5: Any = None
        self.dsets: dict[str, Any] = {}
        self.fd: int | None = None
        if layout is not None and not keep_hdf5 and self._reopen(layout):
            return
        if not os.path.isfile(path):
            raise _problem(
                path,
                "shard file is missing (listed in the manifest); re-copy the dataset "
                "or rewrite it with `mpidl shard`",
                "missing",
            )
        size = os.path.getsize(path)
        if size != shard.bytes:
            raise _problem(
                path,
                f"size {size} bytes, manifest says {shard.bytes} (truncated or "
                "replaced?); re-copy the dataset or rewrite it",
                "size mismatch",
            )
        import h5py

        kwargs: dict[str, Any] = {"rdcc_nbytes": _CHUNK_CACHE}
        if locking is not None:
            kwargs["locking"] = locking
        try:
            self.h5 = h5py.File(path, "r", **kwargs)
        except OSError as e:
            raise DataError(
                f"{path}: cannot be opened as HDF5 ({e}); the file is corrupt: "
                "re-copy the dataset or rewrite it",
                [(path, "not HDF5")],
            ) from e
        try:
            self._check(shard, manifest)
            self.fd = os.open(path, os.O_RDONLY)
            self.layout = ShardLayout(_identity(os.fstat(self.fd)), dict(self.offsets))
        except BaseException:
            self.h5.close()
            raise
        self._map, self.bytes = _map_file(self.fd, size, self.offsets)
        if not keep_hdf5 and all(o is not None for o in self.offsets.values()):
            self.h5.close()  # every feature is read by offset: HDF5 is done
            self.h5, self.dsets = None, {}
        self._release_fd()

    def _reopen(self, layout: ShardLayout) -> bool:
        """Map the file again without HDF5 if it is the file ``layout`` describes."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False  # the full open names the problem
        try:
            if _identity(os.fstat(fd)) != layout.identity or \
                    any(o is None for o in layout.offsets.values()):
                return False
            self.offsets, self.layout = dict(layout.offsets), layout
            self._map, self.bytes = _map_file(fd, layout.identity[2], self.offsets)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._release_fd()
        return True

    def _release_fd(self) -> None:
        """Close our descriptor where the map (or HDF5) does every read without it."""
        if self.fd is not None and (self._map is not None or self.h5 is not None and all(
                o is None for o in self.offsets.values())):
            os.close(self.fd)
            self.fd = None

    def _check(self, shard: Shard, manifest: Manifest) -> None:
        import h5py

        attrs, path = self.h5.attrs, self.path
        if attrs.get("format") not in (SHARD_FORMAT, SHARD_FORMAT.encode()):
            raise _problem(path, f"not an mpidl shard (format attribute {attrs.get('format')!r})")
        did = attrs.get("dataset_id")
        did = did.decode() if isinstance(did, bytes) else did
        if did != manifest.dataset_id:
            raise _problem(
                path,
                f"belongs to dataset {did!r}, the manifest is dataset "
                f"{manifest.dataset_id!r}: a shard from another dataset was copied here",
            )
        self.offsets: dict[str, int | None] = {}
        for name, feat in manifest.features.items():
            d = self.h5.get(name)
            if not isinstance(d, h5py.Dataset):
                raise _problem(
                    path,
                    f"missing dataset {name!r} (the manifest lists features "
                    f"{list(manifest.features)})",
                )
            if d.dtype != feat.dtype:
                raise _problem(
                    path,
                    f"dataset {name!r} has dtype {d.dtype.str}, the manifest says {feat.dtype.str}",
                )
            want = (shard.rows, *feat.shape)
            if d.shape != want:
                raise _problem(
                    path, f"dataset {name!r} has shape {d.shape}, the manifest says {want}"
                )
            self.dsets[name] = d
            # A byte offset exists only for allocated contiguous (hence unfiltered) data.
            self.offsets[name] = (
                d.id.get_offset() if d.chunks is None and hasattr(os, "preadv") else None
            )

    def read(
        self,
        feature: str,
        rows: list[tuple[int, int, int]],
        out: numpy.ndarray,
        flat: numpy.ndarray,
        row_bytes: int,
    ) -> None:
        """For each ``(row, n, pos)`` of ``rows``, read rows ``row .. row + n`` of
        ``feature`` into ``out[pos:pos + n]``.

        ``flat`` is ``out`` viewed as bytes (made once per batch by the caller). The loop
        is this tight on purpose: a batch is a few runs of ~100 KB, and each copy from
        the page cache takes about as long as a few Python calls.
        """
        offset = self.offsets[feature]
        row = n = 0
        try:
            if offset is None:
                for row, n, pos in rows:
                    self.dsets[feature].read_direct(
                        out, numpy.s_[row : row + n], numpy.s_[pos : pos + n]
                    )
                return
            if self.bytes is not None:
                data = self.bytes
                # A map of a file that shrank faults (SIGBUS) instead of reading short:
                # check the size first, so a shard truncated mid-run is an error naming
                # it, like a short read.
                size = self._map.size()  # fstat of the map's own descriptor
                if size < data.size:
                    raise OSError(f"the file shrank to {size} bytes while open ({data.size})")
                for row, n, pos in rows:
                    lo, want = pos * row_bytes, n * row_bytes
                    at = offset + row * row_bytes
                    flat[lo : lo + want] = data[at : at + want]
                return
            fd, preadv = self.fd, os.preadv
            for row, n, pos in rows:
                lo = pos * row_bytes
                want = n * row_bytes
                got = preadv(fd, [flat[lo : lo + want]], offset + row * row_bytes)
                if got != want:
                    raise OSError(f"short read: {got} of {want} bytes")
        except OSError as e:
            raise DataError(
                f"{self.path}: reading rows {row}..{row + n} of {feature!r} failed ({e}); "
                "run `mpidl shard --verify` on the dataset",
                [(self.path, "read error")],
            ) from e

    def advise(self, feature: str, rows: list[tuple[int, int, int]], row_bytes: int) -> None:
        """Ask the kernel to start reading rows ``row .. row + n`` of ``feature`` for each
        ``(row, n, _)`` of ``rows`` into the page cache now (``MADV_WILLNEED`` on the
        map, or ``POSIX_FADV_WILLNEED`` on the descriptor without one: asynchronous),
        so that the copies find them there. Contiguous data only."""
        offset = self.offsets[feature]
        if offset is None:
            return
        try:
            if self._map is not None:
                advise, m = _madvise, self._map
                for row, n, _ in rows:
                    at = offset + row * row_bytes
                    start = at - at % mmap.PAGESIZE  # madvise wants a page-aligned start
                    advise(m, start, at + n * row_bytes - start)
            elif self.fd is not None and hasattr(os, "posix_fadvise"):
                fd, fadvise, will = self.fd, os.posix_fadvise, os.POSIX_FADV_WILLNEED
                for row, n, _ in rows:
                    fadvise(fd, offset + row * row_bytes, n * row_bytes, will)
        except (OSError, ValueError):  # advice only: the read that follows reports a problem
            pass

    def close(self) -> None:
        try:
            if self.h5 is not None:
                self.h5.close()
        finally:
            self.bytes = None  # the only view of the map: it can close now
            try:
                if self._map is not None:
                    self._map.close()
            except BufferError:  # a view still alive somewhere: unmapped when collected
                pass
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def _map_file(fd: int, size: int, offsets: dict[str, int | None]) -> tuple[Any, Any]:
    """A read-only map of the shard and a uint8 view of it (see the module docstring),
    or (None, None): no contiguous data to read by offset, or a filesystem that refuses
    maps (``preadv`` then)."""
    if not size or all(o is None for o in offsets.values()):
        return None, None
    try:
        m = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None, None
    return m, numpy.frombuffer(m, dtype=numpy.uint8)


def _madvise(m: mmap.mmap, start: int, length: int) -> None:
    """``m.madvise(MADV_WILLNEED, start, length)`` (a function, so tests can watch it);
    a no-op where the platform has no ``madvise``."""
    if hasattr(m, "madvise"):
        m.madvise(mmap.MADV_WILLNEED, start, length)


def verify_checksum(path: str, shard: Shard) -> None:
    """Raise DataError if the SHA-256 of ``path`` differs from the manifest's."""
    digest = sha256_file(path)
    if digest != shard.sha256:
        raise _problem(
            path,
            f"sha256 {digest[:16]}... differs from the manifest's {shard.sha256[:16]}...: "
            "the file is corrupt or was modified; re-copy the dataset or rewrite it",
            "checksum mismatch",
        )


def raise_open_file_limit(want: int) -> int:
    """Raise this process's soft limit of open files towards ``want``, never past the hard
    limit; returns the soft limit now in force (unchanged where it already allows ``want``
    or where the platform has no ``resource`` module).

    Process-wide state: for a job to call, visibly, before opening a split of more shards
    than half its limit allows to stay open (``ShardedDataset(max_open=...)``); the
    library never calls it. Only root can raise the hard limit (``ulimit -Hn``).
    """
    try:
        import resource
    except ImportError:
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = getattr(resource, "RLIM_INFINITY", -1)
    if soft == infinite or soft >= want:
        return soft if soft != infinite else want
    new = want if hard == infinite else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return new
