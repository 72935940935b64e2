"""Checkpoints: one HDF5 file per save, written atomically, never pickle.

Layout of ``RUN_DIR/checkpoints/checkpoint-00001200.h5`` (step 1200)::

    /                     attrs: format_version, step, epoch, config (TOML text),
                                 created (unix time), mpidl_version
    /model/<dotted.name>  one dataset per parameter, named by its dotted name as is
    /optimizer/...        Optimizer.state_dict(): "step", "lr", "state.<i>.<name>", ...
    /rng/...              e.g. {"numpy": Generator.bit_generator.state, ...}
    /sampler/...          the sampler's position (epoch, index)
    /extra/...            anything else the trainer keeps (size at save time, metrics)

Integrity (format version 2): every dataset carries the CRC-32 of its bytes
(``__crc32__``), every group's plain values the CRC-32 of their JSON
(``__json_crc32__``), and the root the CRC-32 of step, epoch and config; a load checks
them all, so flipped bytes inside the raw data (which HDF5 reads without complaint) are
a :class:`CheckpointError` naming the file and the item. CRC-32 (zlib) runs at several
GB/s, a small cost next to writing the bytes. Version 1 files (no checksums) still load.

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
import zlib
from typing import Any, Mapping

import numpy

from mpidl.backend import as_numpy

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: before checksums
CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt"     # under CHECKPOINT_DIR: files that failed to load, set aside
_NAME_RE = re.compile(r"^checkpoint-(\d+)\.h5$")
_GROUPS = ("model", "optimizer", "rng", "sampler", "extra")
_JSON_ATTR = "__json__"
_SCALAR_ATTR = "__scalar__"
_ORDER_ATTR = "__order__"
_CRC_ATTR = "__crc32__"
_JSON_CRC_ATTR = "__json_crc32__"


def _crc(data: bytes | numpy.ndarray) -> int:
    if isinstance(data, numpy.ndarray):
        data = numpy.ascontiguousarray(data).view(numpy.uint8).reshape(-1) if data.size else b""
    return zlib.crc32(data)


def _root_crc(step: int, epoch: int, config: str) -> int:
    return zlib.crc32(json.dumps([int(step), int(epoch), str(config)]).encode())


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
            dataset.attrs[_CRC_ATTR] = _crc(numpy.asarray(array))
            if isinstance(value, numpy.generic):
                dataset.attrs[_SCALAR_ATTR] = True
        else:
            plain[key] = _plain(value, f"{where}/{key}")
    if plain:
        text = json.dumps(plain)
        group.attrs[_JSON_ATTR] = text
        group.attrs[_JSON_CRC_ATTR] = _crc(text.encode())
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
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, checkpoint_name(step))
    _write_file(path, step, epoch, config, {"model": model, "optimizer": optimizer,
                                            "rng": rng, "sampler": sampler,
                                            "extra": extra or {}})
    _fsync_dir(directory)
    return path


def companion_name(step: int, rank: int) -> str:
    """The file of rank ``rank``'s part of a sharded checkpoint of ``step``."""
    return f"{checkpoint_name(step)}.rank-{int(rank):05d}"


def save_companion(directory: str | os.PathLike, step: int, rank: int, *,
                   model: Mapping[str, Any], optimizer: Mapping[str, Any]) -> str:
    """Write rank ``rank``'s part of a sharded checkpoint (its pieces of the model and
    optimizer state), atomically; return its path. Not collective: every rank but 0
    writes its own before rank 0 writes the checkpoint itself (:func:`save_checkpoint`
    with ``extra["layout"]`` naming the parts), so a checkpoint file that exists has
    all its parts. Nobody gathers the model."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, companion_name(step, rank))
    trees = {"model": model, "optimizer": optimizer, "rng": {}, "sampler": {},
             "extra": {"rank": int(rank)}}
    _write_file(path, step, 0, "", trees)
    return path


def _write_file(path: str, step: int, epoch: int, config: str,
                trees: Mapping[str, Mapping[str, Any]]) -> None:
    """One checkpoint-format file, atomically: ``PATH.tmp``, fsync, rename."""
    h5py = _h5py()
    tmp = path + ".tmp"
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["step"] = int(step)
            f.attrs["epoch"] = int(epoch)
            f.attrs["config"] = config
            f.attrs["created"] = time.time()
            f.attrs["mpidl_version"] = _mpidl_version()
            f.attrs[_CRC_ATTR] = _root_crc(step, epoch, config)
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


def _mpidl_version() -> str:
    from mpidl import __version__

    return __version__


# -- reading ----------------------------------------------------------------------------

class _Corrupt(Exception):
    """An item of the file failed its checksum (turned into CheckpointError by the loader)."""


def _read_tree(group: Any, verify: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if _JSON_ATTR in group.attrs:
        text = group.attrs[_JSON_ATTR]
        if verify and group.attrs.get(_JSON_CRC_ATTR) != _crc(str(text).encode()):
            raise _Corrupt(f"the plain values of {group.name} fail their checksum")
        try:
            out.update(json.loads(text))
        except ValueError:
            raise _Corrupt(f"the plain values of {group.name} are not valid JSON") from None
    for key, item in group.items():
        if hasattr(item, "keys"):
            out[key] = _read_tree(item, verify)
            continue
        array = item[...]                # an ndarray, 0-d arrays stay arrays
        if verify and item.attrs.get(_CRC_ATTR) != _crc(array):
            raise _Corrupt(f"{item.name} (shape {array.shape}, {array.dtype}) fails its "
                           "checksum")
        out[key] = array[()] if item.attrs.get(_SCALAR_ATTR, False) else array
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
        # No fix here: the caller knows it (mpidl train sets the file aside and resumes
        # from an earlier one; eval and predict take another --checkpoint).
        raise CheckpointError(f"checkpoint {path} cannot be opened: it is truncated, corrupt "
                              f"or not an HDF5 file ({e})") from None
    with f:
        version = _attr(f, "format_version", path)
        if version not in READABLE_VERSIONS:
            raise CheckpointError(f"checkpoint {path} has format version {version}; this mpidl "
                                  f"reads versions {', '.join(map(str, READABLE_VERSIONS))}")
        verify = version >= 2
        try:
            step, epoch = int(_attr(f, "step", path)), int(_attr(f, "epoch", path))
            config = str(_attr(f, "config", path))
            if verify and f.attrs.get(_CRC_ATTR) != _root_crc(step, epoch, config):
                raise _Corrupt("its step, epoch and config fail their checksum")
            trees = {name: _read_tree(f[name], verify) for name in _GROUPS}
        except KeyError as e:
            raise CheckpointError(f"checkpoint {path} lacks a group ({e})") from None
        except (OSError, _Corrupt, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from None
        state = Checkpoint(path=path, step=step, epoch=epoch, config=config,
                           format_version=int(version), **trees)
    layout = state.extra.get("layout")
    if isinstance(layout, dict) and layout.get("kind") == "pieces":
        _assemble_pieces(state, layout)
    return state


def _assemble_pieces(state: Checkpoint, layout: dict[str, Any]) -> None:
    """Read a sharded checkpoint's other parts and put the full state in ``state``
    (the model by name, the optimizer in its data-parallel layout)."""
    from mpidl.parallel.zero import pieces_to_full

    directory, step = os.path.dirname(state.path), state.step
    models, optimizers = [state.model], [state.optimizer]
    for rank in range(1, int(layout["ranks"])):
        part = os.path.join(directory, companion_name(step, rank))
        if not os.path.isfile(part):
            raise CheckpointError(f"checkpoint {state.path} lacks the part of rank {rank}, "
                                  f"{part}; restore it, or resume from an earlier checkpoint")
        try:
            piece = load_checkpoint(part)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint {state.path}: its part of rank {rank} is "
                                  f"unreadable: {e}") from None
        models.append(piece.model)
        optimizers.append(piece.optimizer)
    try:
        state.model, state.optimizer = pieces_to_full(models, optimizers, layout["order"],
                                                      layout.get("buffers", ()))
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {state.path}: its parts do not fit together "
                              f"({e}); resume from an earlier checkpoint") from None


def companions(path: str) -> list[str]:
    """The other ranks' parts of the checkpoint at ``path`` (a sharded one), existing."""
    directory, name = os.path.split(path)
    if not os.path.isdir(directory or "."):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory or ".")
                  if n.startswith(name + ".rank-") and not n.endswith(".tmp"))


def _move(path: str, target_dir: str, suffix: str = "") -> str:
    """Move a checkpoint and its parts into ``target_dir``; return the new path."""
    target = os.path.join(target_dir, os.path.basename(path) + suffix)
    for part in companions(path):
        os.replace(part, os.path.join(target_dir, os.path.basename(part) + suffix))
    os.replace(path, target)
    return target


def listed_checkpoints(directory: str | os.PathLike) -> list[str]:
    """The checkpoint files in ``directory``, oldest first (whether they load or not)."""
    return [path for _, path in _listed(os.fspath(directory))]


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


def newest_loadable(directory: str | os.PathLike
                    ) -> tuple[Checkpoint | None, list[tuple[str, str]]]:
    """The newest checkpoint in ``directory`` that loads and passes its checksums, and
    the newer ones that did not, as ``(path, reason)``, newest first.

    Files left half-written (``*.tmp``) are not checkpoints and are not listed. Each
    file tried is read whole (the checksums cover every array). Not collective.
    """
    bad: list[tuple[str, str]] = []
    for _, path in reversed(_listed(os.fspath(directory))):
        try:
            return load_checkpoint(path), bad
        except (CheckpointError, FileNotFoundError) as e:
            bad.append((path, str(e)))
    return None, bad


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The path of the newest checkpoint in ``directory`` that loads, or None.

    Files left half-written (``*.tmp``) are ignored; a checkpoint that fails to load
    (truncated by a crash, corrupt, another format version) is skipped with a warning
    naming it, and the next older one is returned. Nothing is moved (see
    :func:`set_aside_corrupt`).
    """
    found, bad = newest_loadable(directory)
    for path, reason in bad:
        warnings.warn(f"skipping checkpoint {path}: {reason}", RuntimeWarning, stacklevel=2)
    return found.path if found is not None else None


def set_aside_corrupt(paths: list[str]) -> list[str]:
    """Move checkpoint files that failed to load into ``corrupt/`` beside them; return
    the new paths. Never deleted: a damaged file may still be worth a look, and its
    place must not make it the "latest" again. Call it on one rank."""
    moved = []
    for path in paths:
        directory = os.path.join(os.path.dirname(path), CORRUPT_DIR)
        os.makedirs(directory, exist_ok=True)
        suffix = ""
        if os.path.exists(os.path.join(directory, os.path.basename(path))):
            suffix = f".{time.strftime('%Y%m%d-%H%M%S')}"
        moved.append(_move(path, directory, suffix))
    if moved:
        _fsync_dir(os.path.dirname(paths[0]))
    return moved


def keep_last(directory: str | os.PathLike, k: int) -> list[str]:
    """Delete all but the ``k`` newest checkpoints (with their parts), stale ``.tmp``
    files and parts whose checkpoint was never written (a job killed between the two);
    return them. Call it on the writing rank, after :func:`save_checkpoint`.
    """
    if k < 1:
        raise ValueError(f"keep_last: k must be >= 1, got {k}")
    directory = os.fspath(directory)
    listed = _listed(directory)
    removed = [path for _, path in listed[: max(0, len(listed) - k)]]
    removed += [part for path in list(removed) for part in companions(path)]
    if os.path.isdir(directory):
        names = set(os.listdir(directory))
        removed += [os.path.join(directory, n) for n in names
                    if (n.endswith(".tmp") and _NAME_RE.match(n.split(".h5")[0] + ".h5"))
                    or (".h5.rank-" in n and n.split(".rank-")[0] not in names)]
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
        _move(path, aside)
    _fsync_dir(directory)
    return aside


# The description of the run's training data (mpidl.data.description), written at the
# start of a run: enough to rebuild the model and encode inputs after the data is gone.
DATASET_FILE = "dataset.json"
# What a run writes besides its checkpoints.
RUN_FILES = ("metrics.jsonl", "config.toml", "trace.json", DATASET_FILE)


def set_aside_run(run_dir: str | os.PathLike) -> str | None:
    """Move a run directory's checkpoints and records into ``previous-<time>/``; return
    it (None when there was nothing). For a deliberate fresh start in a used run
    directory (``--resume=never``): the old run's results are moved, never deleted.
    Call it on one rank."""
    run_dir = os.fspath(run_dir)
    checkpoints = os.path.join(run_dir, CHECKPOINT_DIR)
    items = [os.path.join(run_dir, n) for n in RUN_FILES
             if os.path.exists(os.path.join(run_dir, n))]
    if os.path.isdir(checkpoints) and os.listdir(checkpoints):
        items.append(checkpoints)
    if not items:
        return None
    aside = os.path.join(run_dir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(aside, exist_ok=True)
    for item in items:
        os.replace(item, os.path.join(aside, os.path.basename(item)))
    _fsync_dir(run_dir)
    return aside


@dataclasses.dataclass
class ResumePlan:
    """Where a run starts: a checkpoint to resume, or a fresh start.

    Attributes:
        checkpoint: the checkpoint to resume (loaded and checked), or None.
        corrupt: newer checkpoints that failed to load, ``(path, reason)``: set aside
            once the resume has succeeded.
        previous: a fresh start by request in a directory with an earlier run, whose
            files are set aside first.
    """

    checkpoint: Checkpoint | None = None
    corrupt: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    previous: bool = False


def plan_resume(resume: bool | str, run_dir: str | os.PathLike) -> ResumePlan:
    """Decide where a run starts, per the ``resume`` config key. Changes no file.

    ``"auto"`` resumes from the newest checkpoint that loads (the newer ones that do not
    are listed in ``corrupt``); with no checkpoint at all it starts fresh. ``True`` is
    the same, but needs a checkpoint. ``False``/``"never"`` starts fresh (``previous``
    when the directory holds an earlier run). A path names a checkpoint file, or a run
    or checkpoint directory whose newest loadable checkpoint is used.

    Raises:
        FileNotFoundError: ``resume`` names nothing resumable, or is True and there is
            no checkpoint.
        CheckpointError: checkpoints exist, but none loads (each is named with why);
            nothing is changed, and a fresh start must be asked for (``--resume=never``).
    """
    run_dir = os.fspath(run_dir)
    own = os.path.join(run_dir, CHECKPOINT_DIR)
    if resume is False or resume == "never":
        used = any(os.path.exists(os.path.join(run_dir, n)) for n in RUN_FILES)
        return ResumePlan(previous=used or bool(_listed(own)))
    if resume is True or resume == "auto":
        found, bad = newest_loadable(own)
        if found is None and bad:
            raise CheckpointError(_none_loads(own, bad))
        if found is None and resume is True:
            raise FileNotFoundError(f"--resume: no checkpoint in {own}; run without --resume "
                                    "to start fresh")
        return ResumePlan(found, bad)
    target = os.fspath(resume)
    if os.path.isfile(target):
        return ResumePlan(load_checkpoint(target))
    for directory in (os.path.join(target, CHECKPOINT_DIR), target):
        found, bad = newest_loadable(directory) if os.path.isdir(directory) else (None, [])
        if found is not None:
            return ResumePlan(found)  # another directory's bad files are not ours to move
        if bad:
            raise CheckpointError(_none_loads(directory, bad))
    raise FileNotFoundError(f"--resume={target}: no such checkpoint file, and no checkpoint in "
                            f"{target} or {os.path.join(target, CHECKPOINT_DIR)}")


def _none_loads(directory: str, bad: list[tuple[str, str]]) -> str:
    lines = "\n".join(f"  {reason}" for _, reason in bad)
    return (f"{directory} holds {len(bad)} checkpoint{'s' if len(bad) > 1 else ''} and none "
            f"loads:\n{lines}\nNothing was changed. Restore them from a copy, name one that "
            "loads with --resume=PATH, or start over with --resume=never (the old "
            "checkpoints and metrics then move to RUN_DIR/previous-<time>/)")


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
