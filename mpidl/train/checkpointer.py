"""A run's checkpoints: one interface, one class per layout, chosen once.

Every layout writes the same sharded checkpoint (:mod:`mpidl.train.sharded`) and reads
any checkpoint; they differ only in what a rank holds of the single-rank state
(:mod:`mpidl.parallel.holdings`) and what must follow a load:

- :class:`ReplicatedCheckpointer`: data parallelism: every rank holds it all, rank 0
  writes it, every rank reads it all.
- :class:`ZeroCheckpointer`: ZeRO stages 1-3: each rank writes and reads its blocks;
  stages 1-2 then gather the full parameters.
- :class:`GridCheckpointer`: tensor x sequence grid: each tensor rank's slices, written
  by the first replica (the unsplit parameters by tensor rank 0 of it).
- :class:`GridZeroCheckpointer`: the grid with ZeRO over the replicas: the blocks of
  the slices.
- :class:`PipelineCheckpointer`: pipeline stages: each stage's share as its grid (or
  ZeRO) holds it, under the single-rank names.

:func:`choose_checkpointer` picks one from the layout. Save and load are collective over
the world: each rank writes its own part, then rank 0 writes the index; each rank reads
only what it holds. Errors are raised on every rank, naming the rank that failed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from typing import Any, Iterator

from mpidl import storage
from mpidl.backend import dtype_name
from mpidl.comm import DistributedError
from mpidl.comm.ledger import patience
from mpidl.parallel import holdings as hold
from mpidl.parallel import tensor, zero_state
from mpidl.parallel.powersgd_state import PowerSGDState, powersgd_state
from mpidl.parallel.zero import ShardedDataParallel
from mpidl.train import checkpoint as ckpt
from mpidl.train import pieces, sharded
from mpidl.train.checkpoint import CheckpointError


class LoadError(RuntimeError):
    """A checkpoint that does not load here, raised on every rank.

    ``kind``: "model" (another model: names or shapes), "optimizer" (another
    optimizer's state), or "corrupt" (a part missing, unreadable or failing a checksum).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Checkpointer:
    """The interface; subclasses say what this rank holds.

    Args:
        comm: the world (every rank saves and loads).
        model: the model this rank trains (its parameter names are the single-rank
            model's in every layout).
        optimizer: the optimizer over this rank's parameters or shards.
    """

    name = "?"

    def __init__(self, comm: Any, model: Any, optimizer: Any) -> None:
        self.comm, self.model, self.optimizer = comm, model, optimizer
        # The single-rank optimizer's parameter order, and every tensor of the model.
        self.order = [n for n, _ in model.named_parameters()]
        self.buffers = [n for n, _ in model.named_buffers()]
        # State of the gradient exchange itself (PowerSGD's error feedback), or None:
        # saved and loaded beside the optimizer's (choose_checkpointer sets it).
        self.compression: PowerSGDState | None = None

    def holdings(self) -> tuple[list[hold.Held], list[hold.HeldInt]]:
        """This rank's records of the model and optimizer. Not collective."""
        raise NotImplementedError

    def after_load(self) -> None:
        """What must follow setting the records (collective where a subclass says)."""

    # -- saving ------------------------------------------------------------------------------
    def save(self, directory: str, step: int, *, rng: Any, sampler: Any, config: str = "",
             epoch: int = 0, extra: Any = None) -> str:
        """Write the sharded checkpoint of ``step``: every rank its part, then rank 0 the
        index. Collective; returns the index's path on every rank.

        Raises:
            DistributedError: on every rank, when a rank could not write (naming it).
        """
        held, ints = self.holdings()
        if self.compression is not None:
            more, more_ints = self.compression.holdings()
            held, ints = held + more, ints + more_ints
        mine = [h for h in held if h.owner and h.count and h.read() is not None]
        rows, error, written = [], None, None
        # The parts share a filesystem (as a rule): each rank checks there is room for
        # all of them before any is begun (mpidl.storage: HDF5 and a full disk).
        need = sum(self.comm.allgather_obj(sharded.part_bytes(mine) if mine else 0))
        if mine:
            part = os.path.join(directory, sharded.part_name(step, self.comm.rank))
            try:
                os.makedirs(directory, exist_ok=True)
                storage.check_room(part, need)
                rows = sharded.write_part(part, step, self.comm.rank, mine)
                written = part
            except (OSError, RuntimeError) as e:
                error = _storage_error(e, part, "a checkpoint part")
        with patience("the ranks write their checkpoint parts"), _discard_on_failure(written):
            self.comm.check(error is None, str(error))
        keys = {h.key: (h.shape, dtype_name(h.dtype)) for h in mine}
        values = {r.key: r.read() for r in ints if r.owner}
        # Small: a row per piece (key, offsets, CRC), no arrays. Every rank gets every
        # table (the communicator has no gather); only rank 0 keeps them.
        tables = self.comm.allgather_obj((rows, keys, {k: int(v) for k, v in values.items()
                                                       if v is not None}))
        path = os.path.join(directory, ckpt.checkpoint_name(step))
        if self.comm.rank == 0:
            try:
                every = {k: v for _, ks, _ in tables for k, v in ks.items()}
                meta = {"order": self.order, "buffers": self.buffers, "layout": self.name,
                        "ranks": self.comm.size,
                        "optimizer": {"step": int(self.optimizer.step_count),
                                      "lr": float(self.optimizer.lr)}}
                sharded.write_index(
                    directory, step, {r: t[0] for r, t in enumerate(tables) if t[0]}, every,
                    {k: v for _, _, i in tables for k, v in i.items()}, meta=meta, rng=rng,
                    sampler=sampler, config=config, epoch=epoch, extra=extra)
                _remove_stale_parts(path, {r for r, t in enumerate(tables) if t[0]})
            except (OSError, RuntimeError) as e:
                error = _storage_error(e, path, "the checkpoint index")
        with patience("rank 0 writes the checkpoint index"), _discard_on_failure(written):
            self.comm.check(error is None, str(error))
        return path

    # -- loading -----------------------------------------------------------------------------
    def load(self, state: ckpt.Checkpoint, optimizer: bool = True) -> int:
        """Set this rank's model (and optimizer) state from any checkpoint (``state``:
        :func:`~mpidl.train.checkpoint.load_checkpoint`'s, any ``state=``), reading only
        what this rank holds; return the elements read. Collective.

        Raises:
            LoadError: on every rank when one rank failed, its kind and message (the
                model first: a checkpoint of another model is said so).
        """
        read, error = 0, None
        try:
            source = ckpt.open_source(state, self.order)
            # A checkpoint of another precision: parameters from fp32 masters, or back.
            source = pieces.across_precision(source, self.order,
                                             self.optimizer.state_arrays)
        except (CheckpointError, KeyError, OSError) as e:
            source, error = None, ("corrupt", str(e))
        self._agree(error)
        try:
            error = None
            try:
                held, ints = self.holdings()
                pieces.check_keys(source, self.order + self.buffers, (), "model")
                read += pieces.load(source, held, ints, "model")
            except (KeyError, ValueError) as e:
                error = ("model", _first_line(e))
            except (CheckpointError, OSError) as e:
                error = ("corrupt", str(e))
            self._agree(error)
            if optimizer:
                try:
                    if source.optimizer is None:
                        raise KeyError(f"checkpoint {state.path} has no optimizer state")
                    hold.reset_optimizer(self.optimizer, source.optimizer["step"],
                                         source.optimizer["lr"])
                    held, ints = self.holdings()
                    pieces.check_keys(source, self.order, self.optimizer.state_arrays,
                                       "optimizer")
                    read += pieces.load(source, held, ints, "optimizer")
                except (KeyError, ValueError) as e:
                    error = ("optimizer", _first_line(e))
                except (CheckpointError, OSError) as e:
                    error = ("corrupt", str(e))
                self._agree(error)
                if self.compression is not None:
                    try:
                        read += self.compression.load(source, pieces.load)
                    except (KeyError, ValueError) as e:
                        error = ("optimizer", "compression state: " + _first_line(e))
                    except (CheckpointError, OSError) as e:
                        error = ("corrupt", str(e))
                    self._agree(error)
        finally:
            if source is not None:
                source.close()
        self.after_load()
        return read

    def _agree(self, error: tuple[str, str] | None) -> None:
        """Raise the first failing rank's error on every rank. Collective."""
        errors = self.comm.allgather_obj(error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, (kind, message) = failed[0]
            where = f" (rank {rank} of {self.comm.size})" if self.comm.size > 1 else ""
            raise LoadError(kind, message + where)


@contextlib.contextmanager
def _discard_on_failure(part: str | None) -> Iterator[None]:
    """Remove this rank's ``part`` when the save fails on any rank (DistributedError):
    a part without its index is no checkpoint, and it would hold space a full disk
    lacks."""
    try:
        yield
    except DistributedError:
        if part is not None and os.path.exists(part):
            os.remove(part)
        raise


def _storage_error(e: BaseException, path: str, what: str) -> str:
    """The message of a failed write of ``path`` (re-raises ``e`` unless storage failed:
    :func:`mpidl.storage.storage_failure`)."""
    failure = storage.storage_failure(e, path)
    if failure is None:
        raise e
    fix = {errno.ENOSPC: f"free space on that filesystem (`df {os.path.dirname(path)}`), "
                         "keep fewer checkpoints (--keep-checkpoints N needs room for N + 1 "
                         "while saving) or use another --run-dir",
           errno.EDQUOT: "free space within your quota or use another --run-dir",
           errno.EFBIG: "raise the file-size limit (`ulimit -f`)"}.get(
               failure.errno, "fix the run directory's storage or use another --run-dir")
    return (f"cannot write {what} {path}: {failure.strerror}; the checkpoint was not "
            f"written (the earlier ones are kept): {fix}")


def _first_line(error: BaseException) -> str:
    text = str(error).strip("'\" ")
    return text.splitlines()[0] if text else type(error).__name__


def _remove_stale_parts(path: str, ranks: set[int]) -> None:
    """Parts beside the index that it does not name (an earlier save of the same step at
    another rank count, or format 2's companions): not this checkpoint's."""
    for part in ckpt.companions(path):
        tail = part.rsplit(".", 1)[-1]
        if not (tail.startswith("part-") and int(tail[5:]) in ranks):
            os.remove(part)


class ReplicatedCheckpointer(Checkpointer):
    """Data parallelism: the whole state on every rank; rank 0 writes it."""

    name = "replicated"

    def holdings(self) -> tuple[list[hold.Held], list[hold.HeldInt]]:
        writes = self.comm.rank == 0
        return hold.parameter_holdings(list(self.model.named_parameters()),
                                       list(self.model.named_buffers()), self.optimizer,
                                       hold.whole_runs, lambda p: writes, writes)


class ZeroCheckpointer(Checkpointer):
    """ZeRO (``wrapper``: a ShardedDataParallel over the world): this rank's blocks."""

    name = "zero"

    def __init__(self, comm: Any, wrapper: Any, optimizer: Any) -> None:
        super().__init__(comm, wrapper.module, optimizer)
        self.wrapper = wrapper

    def holdings(self) -> tuple[list[hold.Held], list[hold.HeldInt]]:
        return zero_state.holdings(self.wrapper, self.optimizer)

    def after_load(self) -> None:
        zero_state.refresh_after_load(self.wrapper)


class GridCheckpointer(Checkpointer):
    """A tensor x sequence grid (``layout``: :class:`~mpidl.train.layout.Layout`)."""

    name = "grid"

    def __init__(self, comm: Any, layout: Any, model: Any, optimizer: Any) -> None:
        super().__init__(comm, model, optimizer)
        self.layout = layout

    def holdings(self) -> tuple[list[hold.Held], list[hold.HeldInt]]:
        return tensor.holdings(self.model, self.optimizer, self.layout.replicas.rank == 0,
                               self.layout.grid.tensor_rank)


class GridZeroCheckpointer(ZeroCheckpointer):
    """The grid with ZeRO over the replicas: the blocks of this tensor rank's slices."""

    name = "grid+zero"

    def __init__(self, comm: Any, layout: Any, wrapper: Any, optimizer: Any) -> None:
        super().__init__(comm, wrapper, optimizer)
        self.layout = layout

    def holdings(self) -> tuple[list[hold.Held], list[hold.HeldInt]]:
        first = self.layout.grid.tensor_rank == 0

        def owner(p: Any) -> bool:  # unsplit: alike on every tensor rank; one writes
            return getattr(p, "shard", None) is not None or first
        return zero_state.holdings(self.wrapper, self.optimizer, runs_of=tensor.shard_runs,
                             owner_of=owner,
                             buffer_owner=first and self.layout.replicas.rank == 0)


class PipelineCheckpointer(Checkpointer):
    """Pipeline stages (``pipeline``: a :class:`~mpidl.parallel.PipelineModel`): this
    stage's parameters under the single-rank model's names, held as the stage's grid
    holds them (whole, tensor slices, or ZeRO 1-2 blocks of either), written by the
    first replica of the stage. Every element of the single-rank state is in exactly
    one stage (the tied embedding is part 0's parameter), so the checkpoint is the one
    every layout writes, and loads into any other.

    Memory: a rank reads and writes only its stage's share (its parameters and their
    optimizer arrays, no gathered copy), as :class:`GridCheckpointer` does.
    """

    name = "pipeline"

    def __init__(self, comm: Any, layout: Any, pipeline: Any, optimizer: Any) -> None:
        super().__init__(comm, pipeline.module, optimizer)
        self.layout, self.pipeline = layout, pipeline
        self.order = list(pipeline.names)  # the single-rank model's, not the stage's
        self.buffers = sorted({single_rank_name(pipeline, n) for n in self.buffers})
        self.zero = isinstance(pipeline.wrapped, ShardedDataParallel)

    def holdings(self) -> tuple[list[hold.Held], list[hold.HeldInt]]:
        grid = self.layout.grid
        if self.zero:
            first = grid.tensor_rank == 0

            def owner(p: Any) -> bool:  # unsplit: alike on every tensor rank; one writes
                return getattr(p, "shard", None) is not None or first
            held, ints = zero_state.holdings(
                self.pipeline.wrapped, self.optimizer, runs_of=tensor.shard_runs,
                owner_of=owner, buffer_owner=first and grid.replicas.rank == 0)
        else:
            held, ints = tensor.holdings(self.model, self.optimizer, grid.replicas.rank == 0,
                                         grid.tensor_rank)
        return ([dataclasses.replace(h, key=self._key(h.key)) for h in held],
                [dataclasses.replace(h, key=self._key(h.key)) for h in ints])

    def _key(self, key: hold.Key) -> hold.Key:
        return key._replace(name=single_rank_name(self.pipeline, key.name))

    def after_load(self) -> None:
        if self.zero:
            zero_state.refresh_after_load(self.pipeline.wrapped)


def single_rank_name(pipeline: Any, name: str) -> str:
    """The single-rank model's name of the stage's ``parts.{i}.NAME``."""
    _, i, rest = name.split(".", 2)
    return pipeline.module.parts[int(i)].full_name(rest)


def choose_checkpointer(comm: Any, layout: Any, wrapper: Any, model: Any,
                        optimizer: Any) -> Checkpointer:
    """The run's checkpointer, from its layout (None, or ``layout.grid`` None: no grid)
    and wrapper (ZeRO when it is a ShardedDataParallel). Not collective."""
    if layout is not None and getattr(layout, "pipeline", None) is not None:
        return PipelineCheckpointer(comm, layout, layout.pipeline, optimizer)
    zero = isinstance(wrapper, ShardedDataParallel)
    grid = layout is not None and layout.grid is not None
    compression = powersgd_state(wrapper)
    if compression is not None and not (zero or grid):  # the config refuses the others
        chosen = ReplicatedCheckpointer(comm, model, optimizer)
        chosen.compression = compression
        return chosen
    if grid:
        return (GridZeroCheckpointer(comm, layout, wrapper, optimizer) if zero
                else GridCheckpointer(comm, layout, model, optimizer))
    return (ZeroCheckpointer(comm, wrapper, optimizer) if zero
            else ReplicatedCheckpointer(comm, model, optimizer))


__all__ = ["Checkpointer", "LoadError", "ReplicatedCheckpointer", "ZeroCheckpointer",
           "GridCheckpointer", "GridZeroCheckpointer", "PipelineCheckpointer",
           "choose_checkpointer"]
