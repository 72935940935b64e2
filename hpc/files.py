"""Files a command writes: never over one it was not told to replace, and atomically.

Here in ``hpc`` (which knows nothing of deep learning) so that both ``hpc`` and
``mpidl`` write their files one way.

:func:`check_output` is the one rule for every file a command is about to write (a
consolidated checkpoint, a dataset's files, a plan's JSON, plot or batch script, a
benchmark's plot or profile, a run's plots): an existing file is written over only with
``--force``, and a file the command reads (a checkpoint, a dataset, a run's metrics) is
never written over, even with ``--force``: the input would be gone, or half-read.

The text goes to a temporary file beside the target (same file system, so the rename
is atomic), is flushed and fsynced, then renamed over the target. If anything fails (a
full disk is the usual case) the temporary file is removed and the old file is left as
it was; the error is raised as it came (an ``OSError`` naming the cause).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator


class OutputError(ValueError):
    """A file the command must not write (a bad input: exit 2, docs/exit-status.md)."""


def _inside(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def _is_read(path: str, read: str) -> bool:
    """Whether writing ``path`` would touch ``read`` (a file, or any file under a
    directory): the same name after links are resolved, or the same file (a hard link)."""
    real, target = os.path.realpath(path), os.path.realpath(read)
    if os.path.isdir(target):
        return _inside(real, target)
    if real == target:
        return True
    try:
        return os.path.samefile(path, read)
    except OSError:  # one of them does not exist: not the same file
        return False


def check_output(path: str | os.PathLike, *, force: bool, reads: Iterable[str] = (),
                 flag: str = "--force", instead: str = "another file") -> str:
    """``path``, a file the command is about to write, if it may; else OutputError naming
    the file and the fix. Not collective; call it before any work.

    Args:
        force: whether the user asked to write over an existing file (``flag``).
        reads: the files and directories the command reads (a directory: every file in
            it). Never written over, even with ``force``.
        instead: what the message asks to name instead (``"another OUT_DIR"``).
    """
    path = os.fspath(path)
    if not path:
        raise OutputError("an empty file name; name the file to write")
    for read in reads:
        if _is_read(path, os.fspath(read)):
            what = "lies in" if os.path.isdir(read) and os.path.realpath(path) != \
                os.path.realpath(read) else "is"
            raise OutputError(f"{path} {what} {read}, which this command reads: it is never "
                              f"written over, even with {flag}; name {instead}")
    if os.path.lexists(path) and not force:
        raise OutputError(f"{path} already exists; name {instead}, or pass "
                          f"{flag} to write over it")
    return path


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[str]:
    """A temporary name beside ``path`` to write, renamed over ``path`` when the block
    ends without an error; removed (and ``path`` left as it was) when it raises. The
    writer flushes and fsyncs what it writes. Not collective."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text(path: str | os.PathLike, text: str) -> str:
    """Replace ``path`` with ``text`` (UTF-8) atomically; return the path. Not collective."""
    with replacing(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return os.fspath(path)
