"""Checkpoints: one HDF5 file per save, written atomically, never pickle.

Layout of ``RUN_DIR/checkpoints/checkpoint-00001200.h5`` (step 1200)::

    /                     attrs: format_version, step, epoch, config (TOML text),
                                 created (unix time), mpidl_version
    /model/<dotted.name>  one dataset per parameter, named by its dotted name as is
    /optimizer/...        Optimizer.state_dict(): "step", "lr", "state.<i>.<name>", ...
    /rng/...              e.g. {"numpy": Generator.bit_generator.state, ...}
    /sampler/...          the sampler's position (epoch, index)
    /extra/...            anything else the trainer keeps (size at save time, metrics)

A state dict is a tree: a ``dict`` is a group; an array (numpy or cupy) or a numpy scalar
is a dataset (exact dtype and shape); Python ``int``/``float``/``bool``/``str``/``None``
and lists of them are kept together in the group's ``__json__`` attribute. JSON keeps
Python ints of any size exactly, which is what a PCG64 ``bit_generator.state`` holds
(128-bit ``state`` and ``inc``), and ``repr``-exact floats, so RNG states round-trip bit
for bit. Tuples come back as lists. Keys are strings (ints are turned into strings); a
``/`` in a key is an error (HDF5 would make it a path), dots are fine.

Who writes. :func:`save_checkpoint` is not collective: the trainer calls it on rank 0
only (the model and data-parallel optimizer state are identical on every rank) and the
other ranks wait on a barrier after it. The write is atomic: ``NAME.tmp`` in the same
directory, flushed and fsynced, then ``os.replace`` and an fsync of the directory. A
job killed half-way leaves a ``.tmp`` file, which :func:`latest_checkpoint` ignores.
Every rank may then call :func:`load_checkpoint` on the same file (read-only, no lock).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import warnings
from typing import Any, Mapping

import numpy

from mpidl.backend import as_numpy

FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoints"
_NAME_RE = re.compile(r"^checkpoint-(\d+)\.h5$")
_GROUPS = ("model", "optimizer", "rng", "sampler", "extra")
_JSON_ATTR = "__json__"
_SCALAR_ATTR = "__scalar__"
_ORDER_ATTR = "__order__"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: truncated, corrupt, or of another format version."""


@dataclasses.dataclass
class Checkpoint:
    """The contents of a checkpoint file, as NumPy arrays and Python values."""

    path: str
    step: int
    epoch: int
    model: dict[str, numpy.ndarray]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    sampler: dict[str, Any]
    config: str
    extra: dict[str, Any]
    format_version: int = FORMAT_VERSION


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint at ``step``: ``checkpoint-00001200.h5``."""
    return f"checkpoint-{int(step):08d}.h5"


def _h5py():
    import h5py

    return h5py


# -- writing ----------------------------------------------------------------------------

def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _write_tree(group: Any, tree: Mapping[Any, Any], where: str) -> None:
    plain: dict[str, Any] = {}
    for key, value in tree.items():
        key = str(key)
        if "/" in key or key in ("", "."):
            raise ValueError(f"checkpoint key {where}/{key!r} is not a valid HDF5 name "
                             "(no '/', not empty); rename it")
        if isinstance(value, Mapping):
            _write_tree(group.create_group(key), value, f"{where}/{key}")
        elif _is_array(value):
            array = as_numpy(value)
            dataset = group.create_dataset(key, data=array)
            if isinstance(value, numpy.generic):
                dataset.attrs[_SCALAR_ATTR] = True
        else:
            plain[key] = _plain(value, f"{where}/{key}")
    if plain:
        group.attrs[_JSON_ATTR] = json.dumps(plain)
    # HDF5 lists members alphabetically; keep the caller's order (a model's parameter
    # order is the order of its gradient buckets).
    group.attrs[_ORDER_ATTR] = json.dumps([str(k) for k in tree])


def _plain(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise TypeError(f"checkpoint value at {where} is a {type(value).__name__}; use arrays, "
                    "numbers, strings, None, lists or dicts (no pickle in checkpoints)")


def _fsync_dir(directory: str) -> None:
    # The rename is durable only once the directory entry is on disk (POSIX).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(directory: str | os.PathLike, step: int, *, model: Mapping[str, Any],
                    optimizer: Mapping[str, Any], rng: Mapping[str, Any],
                    sampler: Mapping[str, Any], config: str = "", epoch: int = 0,
                    extra: Mapping[str, Any] | None = None) -> str:
    """Write the checkpoint of ``step`` into ``directory`` atomically; return its path.

    Not collective: call it on one rank (the trainer uses rank 0) and make the other
    ranks wait on a barrier. An existing checkpoint of the same step is replaced.

    Args:
        directory: the checkpoint directory (created if missing), e.g. RUN_DIR/checkpoints.
        step: optimizer steps done; names the file.
        model: ``{dotted.name: array}`` (``Module.state_dict()``); cupy arrays are copied
            to the host.
        optimizer: ``Optimizer.state_dict()``.
        rng: RNG states, e.g. ``{"numpy": generator.bit_generator.state}``.
        sampler: the sampler's state (epoch, position) — independent of the number of ranks.
        config: the run's configuration as TOML text.
        epoch: the epoch the run is in (for listings; the sampler state is what resumes).
        extra: anything else, same rules as the other trees.
    """
    h5py = _h5py()
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, checkpoint_name(step))
    tmp = path + ".tmp"
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["step"] = int(step)
            f.attrs["epoch"] = int(epoch)
            f.attrs["config"] = config
            f.attrs["created"] = time.time()
            f.attrs["mpidl_version"] = _mpidl_version()
            trees = {"model": model, "optimizer": optimizer, "rng": rng, "sampler": sampler,
                     "extra": extra or {}}
            for name, tree in trees.items():
                _write_tree(f.create_group(name), tree, name)
            f.flush()
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)
    return path


def _mpidl_version() -> str:
    from mpidl import __version__

    return __version__


# -- reading ----------------------------------------------------------------------------

def _read_tree(group: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _JSON_ATTR in group.attrs:
        out.update(json.loads(group.attrs[_JSON_ATTR]))
    for key, item in group.items():
        if hasattr(item, "keys"):
            out[key] = _read_tree(item)
        elif item.attrs.get(_SCALAR_ATTR, False):
            out[key] = item[()]          # a numpy scalar of the saved dtype
        else:
            out[key] = item[...]         # an ndarray, 0-d arrays stay arrays
    if _ORDER_ATTR in group.attrs:
        order = json.loads(group.attrs[_ORDER_ATTR])
        out = ({k: out[k] for k in order if k in out}
               | {k: v for k, v in out.items() if k not in order})
    return out


def _attr(f: Any, name: str, path: str) -> Any:
    if name not in f.attrs:
        raise CheckpointError(f"checkpoint {path} has no attribute {name!r}; not an mpidl "
                              "checkpoint, or written by an incompatible version")
    value = f.attrs[name]
    return value.item() if isinstance(value, numpy.generic) else value


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint file (any rank; read-only, without HDF5 file locking).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is truncated or corrupt, not an mpidl checkpoint, or of
            another format version; the message names the file.
    """
    h5py = _h5py()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path} cannot be opened, it is truncated or corrupt "
                              f"({e}); delete it to resume from an earlier one") from None
    with f:
        version = _attr(f, "format_version", path)
        if version != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {path} has format version {version}; this mpidl "
                                  f"reads version {FORMAT_VERSION}")
        try:
            trees = {name: _read_tree(f[name]) for name in _GROUPS}
        except KeyError as e:
            raise CheckpointError(f"checkpoint {path} lacks a group ({e})") from None
        except OSError as e:
            raise CheckpointError(f"checkpoint {path} is corrupt ({e})") from None
        return Checkpoint(path=path, step=int(_attr(f, "step", path)),
                          epoch=int(_attr(f, "epoch", path)), config=str(_attr(f, "config", path)),
                          format_version=int(version), **trees)


def _listed(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the checkpoint files in ``directory`` by step (``.tmp`` ignored)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME_RE.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def _readable(path: str) -> bool:
    h5py = _h5py()
    try:
        with h5py.File(path, "r", locking=False) as f:
            return f.attrs.get("format_version") == FORMAT_VERSION and "model" in f
    except OSError:
        return False


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The path of the newest readable checkpoint in ``directory``, or None.

    Files left half-written (``*.tmp``) are ignored; a checkpoint file that cannot be
    opened (truncated by a crash, another format version) is skipped with a warning, and
    the next older one is returned.
    """
    for step, path in reversed(_listed(os.fspath(directory))):
        if _readable(path):
            return path
        warnings.warn(f"skipping checkpoint {path}: truncated, corrupt or another format "
                      "version", RuntimeWarning, stacklevel=2)
    return None


def keep_last(directory: str | os.PathLike, k: int) -> list[str]:
    """Delete all but the ``k`` newest checkpoints (and stale ``.tmp`` files); return them.

    Call it on the writing rank, after :func:`save_checkpoint`.
    """
    if k < 1:
        raise ValueError(f"keep_last: k must be >= 1, got {k}")
    directory = os.fspath(directory)
    listed = _listed(directory)
    removed = [path for _, path in listed[: max(0, len(listed) - k)]]
    if os.path.isdir(directory):
        removed += [os.path.join(directory, n) for n in os.listdir(directory)
                    if _NAME_RE.match(n[:-4]) and n.endswith(".tmp")]
    for path in removed:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    return removed


def set_aside_after(directory: str | os.PathLike, step: int) -> str | None:
    """Move the checkpoints of steps after ``step`` into a subdirectory; return it.

    A run resumed from an older checkpoint starts a new branch: the newer checkpoints
    belong to the one abandoned, and left in place they would be the ``latest`` that a
    plain rerun resumes from, and the ones ``keep_last`` keeps instead of the new
    branch's. Moved, not deleted: they are someone's results. Call it on one rank.
    """
    directory = os.fspath(directory)
    newer = [path for s, path in _listed(directory) if s > step]
    if not newer:
        return None
    aside = os.path.join(directory, f"abandoned-after-{int(step):08d}-"
                                    f"{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside, exist_ok=True)
    for path in newer:
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    _fsync_dir(directory)
    return aside


def resolve_resume(resume: bool | str, run_dir: str | os.PathLike) -> str | None:
    """The checkpoint a run resumes from, per the ``resume`` config key.

    Args:
        resume: ``"auto"``: the latest checkpoint of ``RUN_DIR/checkpoints`` if any, else
            None (a fresh start). ``True``: the same, but none is an error. ``False`` (or
            ``"never"``): None. Any other string: a checkpoint file, or a run directory or
            checkpoint directory whose latest checkpoint is used.
        run_dir: the run directory.

    Raises:
        FileNotFoundError: ``resume`` names a path with no checkpoint, or is True and the
            run directory has none.
    """
    own = os.path.join(os.fspath(run_dir), CHECKPOINT_DIR)
    if resume is False or resume == "never":
        return None
    if resume is True or resume == "auto":
        path = latest_checkpoint(own)
        if path is None and resume is True:
            raise FileNotFoundError(f"--resume: no checkpoint in {own}; run without --resume "
                                    "to start fresh")
        return path
    target = os.fspath(resume)
    if os.path.isfile(target):
        return target
    for directory in (os.path.join(target, CHECKPOINT_DIR), target):
        path = latest_checkpoint(directory) if os.path.isdir(directory) else None
        if path is not None:
            return path
    raise FileNotFoundError(f"--resume={target}: no such checkpoint file, and no checkpoint in "
                            f"{target} or {os.path.join(target, CHECKPOINT_DIR)}")
