"""Text files replaced atomically: readers see the old file or the new one, never half.

Here in ``hpc`` (which knows nothing of deep learning) so that both ``hpc`` and
``mpidl`` write their files one way.

The text goes to a temporary file beside the target (same file system, so the rename
is atomic), is flushed and fsynced, then renamed over the target. If anything fails (a
full disk is the usual case) the temporary file is removed and the old file is left as
it was; the error is raised as it came (an ``OSError`` naming the cause).
"""
from __future__ import annotations

import os


def write_text(path: str | os.PathLike, text: str) -> str:
    """Replace ``path`` with ``text`` (UTF-8) atomically; return the path. Not collective."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
