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

Exit codes: 0 written; 2 no such checkpoint, one that does not load (named), or a bad
``OUT``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from mpidl.train import checkpoint as ckpt
from mpidl.train import checkpoint_file, sharded

EXIT_USAGE = 2


def run_dir_of(path: str) -> str:
    """The run directory of a checkpoint file (``RUN_DIR/checkpoints/NAME``)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(path)))


def find_checkpoint(target: str) -> str:
    """``target`` itself when it is a file, else the newest checkpoint of the run or
    checkpoint directory that loads. FileNotFoundError when there is none."""
    if os.path.isfile(target):
        return target
    for directory in (os.path.join(target, ckpt.CHECKPOINT_DIR), target):
        if os.path.isdir(directory):
            path = ckpt.latest_checkpoint(directory)
            if path is not None:
                return path
    raise FileNotFoundError(f"{target}: no such checkpoint file, and no checkpoint that "
                            f"loads in {target} or {os.path.join(target, ckpt.CHECKPOINT_DIR)}")


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
    return parser


def main(argv: Sequence[str]) -> int:
    """``mpidl checkpoint consolidate RUN_DIR|CHECKPOINT [OUT]``."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    try:
        path = find_checkpoint(args.source)
        out = args.out or os.path.join(run_dir_of(path), "consolidated")
        if os.path.isdir(out) or out.endswith(os.sep) or args.out is None:
            out = os.path.join(out, os.path.basename(path))
        if os.path.abspath(out) == os.path.abspath(path):
            raise ValueError(f"OUT {out} is the checkpoint itself; name another file")
        written = consolidate(path, out)
    except (FileNotFoundError, ValueError, ckpt.CheckpointError) as e:
        print(f"mpidl checkpoint consolidate: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"mpidl checkpoint consolidate: error: cannot write {out}: {e}", file=sys.stderr)
        return 1
    print(f"{path} -> {written}")
    return 0


__all__ = ["consolidate", "find_checkpoint", "main"]
