"""Writes that fail for want of storage: one rule for telling them, and for checking room.

A full disk (ENOSPC), a quota (EDQUOT) or a file-size limit (EFBIG) reaches a writer of
HDF5 files in several shapes: an ``OSError`` whose message buries the reason; a
``RuntimeError`` when HDF5 meets it while closing an object ("Can't decrement id ref
count (file write failed: ..., errno = 28, error message = 'No space left on device'
...)"), often with the ``OSError`` as its context, and at times surfacing outside any
handler (under ``mpidl train``: an "unhandled exception" whose traceback holds only
h5py's deallocation frames). :func:`storage_failure` reads the
reason from any of them, so that ``mpidl shard`` and the checkpoints say "No space left
on device" and the fix, and tell it apart from a bug (which is not theirs to catch).

Worse, an HDF5 file that met a full disk may crash the process at its next flush (h5py
3.16 here: a segfault in ``File.flush`` after failed metadata writes). So a writer first
asks :func:`check_room` whether the bytes it is about to write fit, and fails cleanly,
before HDF5 starts, when they do not; a disk that fills during the write (another job)
is the race that is left, and :func:`storage_failure` handles what surfaces of it.
"""
from __future__ import annotations

import errno as errno_module
import os
import re

_HDF5_ERRNO = re.compile(r"errno = (\d+)")
_HDF5_REASON = re.compile(r"error message = '([^']*)'")
# HDF5's own layout around the data: object headers, attributes, B-trees, free space.
# Bounds with room to spare over checkpoints and shards measured here (0.4-1 KiB a
# dataset with its attributes, 2-12 KiB a file).
PER_DATASET = 2 << 10
PER_FILE = 64 << 10


def storage_failure(e: BaseException, path: str) -> OSError | None:
    """The failure of storage behind ``e``, as ``OSError(errno, reason, path)``; None
    when ``e`` is not one (a bug, a bad value: the caller re-raises it).

    The first errno in ``e``'s chain (``__cause__``/``__context__``) wins: an OSError's
    own, or the ``errno = N`` of an HDF5 message.
    """
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return OSError(seen.errno, os.strerror(seen.errno), path)
        if isinstance(seen, (OSError, RuntimeError)):
            found = _HDF5_ERRNO.search(str(seen))
            if found and int(found.group(1)):
                number = int(found.group(1))
                return OSError(number, os.strerror(number), path)
        seen = seen.__cause__ or seen.__context__
    if isinstance(e, OSError):  # HDF5's without an errno (a truncated write, say)
        found = _HDF5_REASON.search(str(e))
        return OSError(errno_module.EIO, found.group(1) if found else str(e), path)
    return None


def write_error(e: BaseException, path: str) -> OSError:
    """:func:`storage_failure` of a write of ``path`` known to have failed in HDF5 (an
    error of another kind becomes an I/O error that quotes it)."""
    failure = storage_failure(e, path)
    if failure is not None:
        return failure
    found = _HDF5_REASON.search(str(e))
    return OSError(errno_module.EIO, found.group(1) if found else str(e), path)


def check_room(path: str, nbytes: int) -> None:
    """Fail now, with a plain ``OSError`` naming ``path``, if a file of ``nbytes`` cannot
    be written there: past the process's file-size limit (EFBIG, ``ulimit -f``) or past
    the filesystem's free space (ENOSPC, from ``statvfs``; one that cannot say passes).

    Why: when a write fails inside HDF5, the library keeps the half-written file open,
    and the process crashed (SIGSEGV in the next ``flush``, or "free(): invalid pointer"
    at exit; measured here with h5py 3.16 / HDF5 2.0 under ``ulimit -f`` and on a full
    tmpfs), so ``mpidl shard`` ended with signal 11 instead of exit status 1, and a
    checkpoint under ``mpiexec`` brought the job down. The limit check is exact; the space
    check can lose a race with another writer, and a quota (EDQUOT) is not seen: those
    still get HDF5's error (:func:`storage_failure`). Writing the file in memory first
    (HDF5's core driver) avoids both but wrote 5-10x slower here (page faults of fresh
    80 MB buffers on the loaded machine), and a checkpoint may not fit in memory twice;
    ``posix_fallocate`` would see a quota, but glibc emulates it by writing every block
    where the filesystem lacks it, and HDF5 truncates the file it creates.
    """
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and nbytes > limit:
        raise OSError(errno_module.EFBIG, os.strerror(errno_module.EFBIG), path)
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return
    if st.f_bavail * st.f_frsize < nbytes:
        raise OSError(errno_module.ENOSPC, os.strerror(errno_module.ENOSPC), path)


def hdf5_bytes(data_bytes: int, datasets: int) -> int:
    """An upper bound on the size of an HDF5 file of ``datasets`` datasets holding
    ``data_bytes`` bytes (contiguous, unfiltered)."""
    return int(data_bytes) + PER_DATASET * int(datasets) + PER_FILE


__all__ = ["storage_failure", "write_error", "check_room", "hdf5_bytes"]
