"""Checkpoints: HDF5 files written atomically, never pickle; reading them; where a run resumes.

A replicated checkpoint (format 2), ``RUN_DIR/checkpoints/checkpoint-00001200.h5``
(step 1200)::

    /                     attrs: format_version, step, epoch, config (TOML text),
                                 created (unix time), mpidl_version
    /model/<dotted.name>  one dataset per parameter, named by its dotted name as is
    /optimizer/...        Optimizer.state_dict(): "step", "lr", "state.<i>.<name>", ...
    /rng/...              e.g. {"numpy": Generator.bit_generator.state, ...}
    /sampler/...          the sampler's position (epoch, index)
    /extra/...            anything else the trainer keeps (size at save time, metrics)

A sharded checkpoint (format 3, what ``mpidl train`` writes in every layout) has the same
name for its index, with each rank's part beside it (:mod:`mpidl.train.sharded`);
:func:`load_checkpoint` reads both, whole or not (``state=``). Trees, checksums and the
atomic write: :mod:`mpidl.train.checkpoint_file`; listing, rotation and setting files
aside: :mod:`mpidl.train.retention`.

Who writes. :func:`save_checkpoint` is not collective: call it on one rank and make the
other ranks wait on a barrier; every rank may then call :func:`load_checkpoint` on the
same file (read-only, no lock). A job killed half-way leaves a ``.tmp`` file, which
:func:`latest_checkpoint` ignores.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping

from mpidl.parallel.zero_state import pieces_to_full
from mpidl.train import pieces, sharded
from mpidl.train.checkpoint_file import (_CRC_ATTR, _GROUPS, FORMAT_VERSION, READABLE_VERSIONS,
                                         STATES, CheckpointError, _attr, _Corrupt, _fsync_dir,
                                         _h5py, _read_tree, _root_crc, _write_file,
                                         checkpoint_name)
# Listing, rotation and setting aside live in mpidl.train.retention; the names stay
# importable from here for the callers of this module.
from mpidl.train.retention import (CHECKPOINT_DIR, CORRUPT_DIR, DATASET_FILE,  # noqa: F401
                                   RUN_FILES, _listed, companions, keep_last,
                                   listed_checkpoints, set_aside_after, set_aside_corrupt,
                                   set_aside_run)


@dataclasses.dataclass
class Checkpoint:
    """The contents of a checkpoint file, as NumPy arrays and Python values."""

    path: str
    step: int
    epoch: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    sampler: dict[str, Any]
    config: str
    extra: dict[str, Any]
    format_version: int = FORMAT_VERSION
    # A sharded checkpoint's table of pieces (format 3, mpidl.train.sharded), else None.
    index: dict[str, Any] | None = None


# -- writing ----------------------------------------------------------------------------

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


# -- reading ----------------------------------------------------------------------------

def load_checkpoint(path: str | os.PathLike, state: str = "full") -> Checkpoint:
    """Read a checkpoint file (any rank; read-only, without HDF5 file locking).

    ``state`` says what to read of the model and optimizer: ``"full"`` both, whole (a
    sharded checkpoint is assembled: ``mpidl checkpoint consolidate``, or tests);
    ``"model"`` the model only (eval, predict); ``"none"`` neither, for a resume that
    reads its share itself (:mod:`mpidl.train.sharded`): a single file's arrays are
    then checked one at a time and dropped, a sharded one's parts must exist.

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
        if state not in STATES:
            raise ValueError(f"load_checkpoint: state={state!r}; one of {STATES}")
        is_sharded = version >= 3
        groups = ("rng", "sampler", "extra", "index") if is_sharded else _GROUPS
        arrays = {"model": True if state != "none" else None,
                  "optimizer": {"full": True, "model": False, "none": None}[state]}
        if version < 2 and state != "full":  # nothing to check: not read
            arrays = {"model": state == "model" or False, "optimizer": False}
        try:
            step, epoch = int(_attr(f, "step", path)), int(_attr(f, "epoch", path))
            config = str(_attr(f, "config", path))
            if verify and f.attrs.get(_CRC_ATTR) != _root_crc(step, epoch, config):
                raise _Corrupt("its step, epoch and config fail their checksum")
            trees = {name: _read_tree(f[name], verify, arrays.get(name, True))
                     for name in groups}
        except KeyError as e:
            raise CheckpointError(f"checkpoint {path} lacks a group ({e})") from None
        except (OSError, _Corrupt, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from None
    index = trees.pop("index", None)
    trees.setdefault("model", {})
    trees.setdefault("optimizer", {})
    loaded = Checkpoint(path=path, step=step, epoch=epoch, config=config,
                        format_version=int(version), index=index, **trees)
    if is_sharded:
        sharded.read_state(loaded, state)
        return loaded
    if state == "none":
        loaded.model, loaded.optimizer = {}, {}
    elif state == "model":
        loaded.optimizer = {}
    layout = loaded.extra.get("layout")
    if state != "none" and isinstance(layout, dict) and layout.get("kind") == "pieces":
        _assemble_pieces(loaded, layout)
    return loaded


def open_source(state: Checkpoint, order: list[str]) -> pieces.Source:
    """The pieces of a loaded checkpoint (:func:`load_checkpoint` with any ``state``): a
    sharded one's index and parts, a single file's datasets read as needed, or the state
    already in memory. ``order``: the parameters' names in the optimizer's order (the
    single-rank model's). Not collective."""
    if state.index is not None:
        return sharded.ShardedSource(state.path, state.index)
    if state.model:
        return pieces.StateSource(state.path, state.model, state.optimizer, order)
    layout = state.extra.get("layout")
    if isinstance(layout, dict) and layout.get("kind") == "pieces":
        # Format 2 with companions (ZeRO before format 3): assembled whole, as it was.
        full = load_checkpoint(state.path)
        return pieces.StateSource(state.path, full.model, full.optimizer, order)
    return pieces.file_source(state.path, order)


def _assemble_pieces(state: Checkpoint, layout: dict[str, Any]) -> None:
    """Read a sharded checkpoint's other parts and put the full state in ``state``
    (the model by name, the optimizer in its data-parallel layout)."""
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
    if not optimizers[0]:  # state="model": the optimizer's pieces were not read
        optimizers = [{} for _ in optimizers]
    try:
        state.model, state.optimizer = pieces_to_full(models, optimizers, layout["order"],
                                                      layout.get("buffers", ()))
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {state.path}: its parts do not fit together "
                              f"({e}); resume from an earlier checkpoint") from None


def newest_loadable(directory: str | os.PathLike, state: str = "full",
                    bad: list[tuple[str, str]] = ()
                    ) -> tuple[Checkpoint | None, list[tuple[str, str]]]:
    """The newest checkpoint in ``directory`` that loads and passes its checksums, and
    the newer ones that did not, as ``(path, reason)``, newest first.

    Files left half-written (``*.tmp``) are not checkpoints and are not listed. Each
    file tried is read whole (the checksums cover every array; ``state`` as
    :func:`load_checkpoint`'s: what is kept). ``bad``: ``(path, reason)`` of
    checkpoints already found damaged (a part, while a resume read it): passed over, and
    listed first. Not collective.
    """
    bad = list(bad)
    known = {p for p, _ in bad}
    for _, path in reversed(_listed(os.fspath(directory))):
        if path in known:
            continue
        try:
            return load_checkpoint(path, state), bad
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
    found, bad = newest_loadable(directory, "none")
    for path, reason in bad:
        warnings.warn(f"skipping checkpoint {path}: {reason}", RuntimeWarning, stacklevel=2)
    return found.path if found is not None else None


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


def plan_resume(resume: bool | str, run_dir: str | os.PathLike, state: str = "full",
                bad: list[tuple[str, str]] = ()) -> ResumePlan:
    """Decide where a run starts, per the ``resume`` config key. Changes no file.

    ``"auto"`` resumes from the newest checkpoint that loads (the newer ones that do not
    are listed in ``corrupt``); with no checkpoint at all it starts fresh. ``True`` is
    the same, but needs a checkpoint. ``False``/``"never"`` starts fresh (``previous``
    when the directory holds an earlier run). A path names a checkpoint file, or a run
    or checkpoint directory whose newest loadable checkpoint is used. ``state``: what
    the checkpoint keeps of the model and optimizer (:func:`load_checkpoint`); ``bad``:
    checkpoints found damaged since (:func:`newest_loadable`).

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
        found, bad = newest_loadable(own, state, bad)
        if found is None and bad:
            raise CheckpointError(_none_loads(own, bad))
        if found is None and resume is True:
            raise FileNotFoundError(f"--resume: no checkpoint in {own}; run without --resume "
                                    "to start fresh")
        return ResumePlan(found, bad)
    target = os.fspath(resume)
    if os.path.isfile(target):
        return ResumePlan(load_checkpoint(target, state))
    for directory in (os.path.join(target, CHECKPOINT_DIR), target):
        found, bad = (newest_loadable(directory, state) if os.path.isdir(directory)
                      else (None, []))
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
