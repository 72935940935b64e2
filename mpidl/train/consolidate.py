"""``mpidl checkpoint``: a run's checkpoints as a single full file.

Run (one process; no launcher needed)::

    mpidl checkpoint consolidate runs/gpt               # the newest checkpoint that loads
    mpidl checkpoint consolidate runs/gpt/checkpoints/checkpoint-00000030.h5 gpt-30.h5

``consolidate`` writes the single-rank model and optimizer state of a sharded checkpoint
(:mod:`mpidl.train.sharded`) into one format-2 file, as a data-parallel run of the same
model would have written it: for ``mpidl eval``/``predict --checkpoint``, for sharing, or
for another tool. It is the one place where the whole state is asked for, and it is
written one tensor at a time (the process holds one tensor, never the state). Without
``OUT`` the file goes to ``RUN_DIR/consolidated/`` under its checkpoint's name, outside
the run's own checkpoints. Every part's blocks are checked against their CRC-32s on the
way. An older checkpoint (format 1 or 2) is written as format 2 too.

``OUT`` is never a file of the checkpoint read, nor of its run's checkpoints (not even
with ``--force``); an existing ``OUT`` is written over only with ``--force``
(:func:`hpc.files.check_output`). Under a launcher rank 0 writes the file while the other
ranks wait; every rank exits with its status.

Exit codes (docs/exit-status.md): 0 written; 2 no such checkpoint, none that loads (each
named), or an ``OUT`` that must not or cannot be written; 1 the storage failed while
writing (a full disk: nothing is left behind).
"""
from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Iterator, Sequence

from hpc.env import detect
from hpc.files import OutputError, check_output
from mpidl.storage import check_room, write_error
from mpidl.train import checkpoint as ckpt
from mpidl.train import checkpoint_file, retention, sharded

EXIT_USAGE = 2


def run_dir_of(path: str) -> str:
    """The run directory of a checkpoint file (``RUN_DIR/checkpoints/NAME``)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(path)))


def find_checkpoint(target: str) -> str:
    """``target`` itself when it is a file, else the newest checkpoint of the run or
    checkpoint directory that loads. FileNotFoundError when there is none."""
    for path in candidates(target, []):
        return path
    raise AssertionError("unreachable")  # candidates() raises when there is none


def candidates(target: str, bad: list[tuple[str, str]]) -> Iterator[str]:
    """The checkpoints to try for ``target``: ``target`` itself when it is a file, else
    each checkpoint of the run or checkpoint directory whose index loads, newest first
    (an older one is tried when a newer one's parts turn out damaged, as training falls
    back). Those passed over go to ``bad`` as ``(path, reason)``; the caller adds the
    ones it finds damaged. Not collective.

    Raises:
        FileNotFoundError: no checkpoint there.
        CheckpointError: checkpoints there, and none loads (each in ``bad``, named).
    """
    if os.path.isfile(target):
        yield target
        return
    for directory in (os.path.join(target, ckpt.CHECKPOINT_DIR), target):
        listed = retention.listed_checkpoints(directory) if os.path.isdir(directory) else []
        for path in reversed(listed):
            try:
                ckpt.load_checkpoint(path, "none")  # the index, and that every part exists
            except (ckpt.CheckpointError, FileNotFoundError) as e:
                bad.append((path, str(e)))
                continue
            yield path
        if listed:
            raise ckpt.CheckpointError(f"{directory} holds {len(listed)} checkpoint(s) and "
                                       "none loads:\n" + "\n".join(f"  {r}" for _, r in bad))
    raise FileNotFoundError(f"{target}: no such checkpoint file, and no checkpoint that "
                            f"loads in {target} or {os.path.join(target, ckpt.CHECKPOINT_DIR)}")


def checkpoint_files(path: str) -> list[str]:
    """What ``consolidate`` never writes over when it reads ``path``: a run's whole
    checkpoint directory, else every checkpoint beside ``path`` with its parts."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.basename(directory) == ckpt.CHECKPOINT_DIR:
        return [directory]
    listed = set(retention.listed_checkpoints(directory)) | {os.path.abspath(path)}
    return [f for cp in sorted(listed) for f in (cp, *retention.companions(cp))]


def consolidate(path: str, out: str) -> str:
    """Write checkpoint ``path`` (any format) into ``out`` as one full format-2 file;
    return ``out``. Not collective.

    Raises:
        CheckpointError: ``path`` does not load (a part missing or damaged: named).
    """
    state = ckpt.load_checkpoint(path, "none")
    extra = {k: v for k, v in state.extra.items() if k != "layout"}
    trees = {"rng": state.rng, "sampler": state.sampler, "extra": extra}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if state.index is not None:
        with sharded.ShardedSource(state.path, state.index) as source:
            model, optimizer = sharded.full_trees(source)  # made as written
            checkpoint_file._write_file(out, state.step, state.epoch, state.config,
                                        {"model": model, "optimizer": optimizer, **trees})
    else:
        full = ckpt.load_checkpoint(path)  # format 1 or 2: whole (companions assembled)
        checkpoint_file._write_file(out, state.step, state.epoch, state.config,
                                    {"model": full.model, "optimizer": full.optimizer,
                                     **trees})
    checkpoint_file._fsync_dir(os.path.dirname(os.path.abspath(out)))
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpidl checkpoint",
                                     description="Work on a run's checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    c = commands.add_parser("consolidate", help="write a checkpoint as one full file",
                            description="Write a checkpoint (a sharded one too) as one "
                                        "full format-2 file, one tensor at a time.")
    c.add_argument("source", metavar="RUN_DIR|CHECKPOINT",
                   help="a run directory (its newest checkpoint that loads) or a checkpoint")
    c.add_argument("out", metavar="OUT", nargs="?",
                   help="the file to write, or a directory for it (default: "
                        "RUN_DIR/consolidated/)")
    c.add_argument("--force", action="store_true",
                   help="write over an existing OUT (never over a checkpoint's file)")
    return parser


def main(argv: Sequence[str]) -> int:
    """``mpidl checkpoint consolidate RUN_DIR|CHECKPOINT [OUT] [--force]``.

    One process's work: under a launcher rank 0 consolidates while the other ranks
    wait (the ranks would otherwise all write one file), then every rank exits with
    rank 0's status.
    """
    if detect().size <= 1:
        return _main(argv)
    # here: only a launch of several ranks needs MPI (one process never initialises it)
    from mpidl.comm import world
    from mpidl.comm.ledger import patience

    comm = world()
    code = _main(argv) if comm.rank == 0 else None
    with patience("rank 0 consolidates the checkpoint"):
        return comm.bcast_obj(code)


_STORAGE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)  # exit 1: not the input


def _main(argv: Sequence[str]) -> int:
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    say = "mpidl checkpoint consolidate: error:"
    out = args.out
    try:
        if out == "":
            raise OutputError("OUT '' is an empty file name; name the file to write, or "
                              "leave OUT out for RUN_DIR/consolidated/")
        bad: list[tuple[str, str]] = []
        for path in candidates(args.source, bad):
            out = _out_path(args.out, path, args.force)
            _check_room(path, out)
            try:
                written = consolidate(path, out)
            except ckpt.CheckpointError as e:
                if os.path.isfile(args.source):
                    raise
                bad.append((path, str(e)))  # a damaged part: the next older one
                continue
            for skipped, reason in bad:
                print(f"mpidl checkpoint consolidate: note: skipped {skipped}: {reason}",
                      file=sys.stderr)
            print(f"{path} -> {written}")
            return 0
    except (FileNotFoundError, OutputError, ckpt.CheckpointError) as e:
        print(f"{say} {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        e = write_error(e, out)
        if e.errno in _STORAGE:
            print(f"{say} cannot write {out} ({e.strerror}); nothing was left behind: free "
                  "space there or name another OUT", file=sys.stderr)
            return 1
        print(f"{say} {out} cannot be written ({e.strerror}); name a file in a directory you "
              "can write", file=sys.stderr)
        return EXIT_USAGE
    raise AssertionError("unreachable")  # candidates() yields, or raises


def _check_room(path: str, out: str) -> None:
    """OSError (ENOSPC or EFBIG, :func:`mpidl.storage.check_room`) when ``out`` cannot
    hold checkpoint ``path`` written whole (about the size of its files: the same
    arrays). Checked first: HDF5 that runs out of space mid-file can crash the process
    (signal 11)."""
    need = sum(os.path.getsize(f) for f in (path, *retention.companions(path)))
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    check_room(os.path.join(parent, os.path.basename(out)), need)


def _out_path(given: str | None, path: str, force: bool) -> str:
    """The file to write for checkpoint ``path`` (OUT, a directory for it, or the default),
    checked: OutputError when it must not be written."""
    out = given or os.path.join(run_dir_of(path), "consolidated")
    if os.path.isdir(out) or out.endswith(os.sep) or given is None:
        out = os.path.join(out, os.path.basename(path))
    check_output(out, force=force, reads=checkpoint_files(path))
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):  # the nearest folder that exists must take files
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise OutputError(f"OUT {out} cannot be written: {parent} is a file, not a directory; "
                          "name a file in a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"OUT {out} cannot be written: {parent} is not writable (permission "
                          "denied); name a file in a directory you can write")
    return out


__all__ = ["candidates", "checkpoint_files", "consolidate", "find_checkpoint", "main"]
