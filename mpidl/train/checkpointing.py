"""A run's checkpoints: what ``mpidl train`` saves of a built run, and restores into one.

The model and optimizer state go through the layout's
:class:`~mpidl.train.checkpointer.Checkpointer` (each rank writes and reads only its
share); this module adds what the run keeps beside them, all independent of the number
of ranks: the dropout generators of every data rank, the sampler's position (epoch,
step), the configuration and the trainer's ``extra`` (rank count, the open train
window, skipped steps, the loss scale). Resuming continues bit for bit on as many data
ranks (on another number: equal up to float summation order).
"""
from __future__ import annotations

import zlib
from typing import Any, Callable

import numpy

from mpidl.backend import as_numpy
from mpidl.comm.ledger import patience
from mpidl.optim import params_finite
from mpidl.train import checkpoint as ckpt
from mpidl.train.build import Run
from mpidl.train.checkpointer import LoadError, choose_checkpointer, single_rank_name
from mpidl.train.config import ConfigError, to_toml
from mpidl.train.log import Logger
from mpidl.train.model import another_model, first_line, seed_dropout_per_rank
from mpidl.train.retention import keep_last
from mpidl.train.rundir import checkpoint_dir, last_checkpoint


class RunCheckpoints:
    """Saving and restoring ``run`` in ``run_dir``'s ``checkpoints/``. Not collective to
    make (the layout's checkpointer is chosen once, here).

    Args:
        run: the run's parts (:func:`~mpidl.train.build.build_run`).
        run_dir: the run directory (the same path on every rank).
        log: where warnings go (rank 0 prints).
    """

    def __init__(self, run: Run, run_dir: str, log: Logger) -> None:
        self.run, self.run_dir, self.log = run, run_dir, log
        self.directory = checkpoint_dir(run_dir)
        # How this layout saves and loads its share of the state, chosen once.
        self.checkpointer = choose_checkpointer(run.comm, run.layout, run.dp, run.model,
                                                run.optimizer)

    def last(self) -> str:
        """The newest checkpoint written, or ``"none written yet"``. Not collective."""
        return last_checkpoint(self.run_dir)

    def save(self, step: int, extra: Callable[[], dict[str, Any]]) -> str | None:
        """Write a checkpoint of step ``step``: every rank its part, rank 0 the index
        (:mod:`mpidl.train.checkpointer`), then rank 0 keeps the newest
        ``keep_checkpoints``. Collective, and so is ``extra()``: the trainer's values
        to keep beside the state, asked for only when a checkpoint is written.

        Not from non-finite parameters: then nothing is written or rotated (the last
        good checkpoint stays) and None is returned, with a warning.
        """
        run, comm = self.run, self.run.comm
        path = None
        error = None
        if comm.agree_each(not bool(params_finite(run.dp.parameters())))[0]:
            self.log.info(f"warning: no checkpoint at step {step}: the parameters are not "
                          f"finite; the last good one is kept ({self.last()})")
            return None
        self.check_replicas(step)
        rng = self.rng_states()
        kept = extra()
        # Every rank writes its own part of the state (nobody gathers it), then rank 0
        # the index; an index on disk means all its parts are.
        try:
            sampler = run.loader.state_dict()
            path = self.checkpointer.save(
                self.directory, step, rng=rng, sampler=sampler, config=to_toml(run.config),
                epoch=sampler["epoch"], extra=kept)
            if comm.rank == 0:
                keep_last(self.directory, run.config.keep_checkpoints)
        except OSError as e:
            error = f"cannot remove old checkpoints in {self.directory}: {e}"
        with patience("rank 0 removes old checkpoints"):
            comm.check(error is None, str(error))
        return path

    def restore(self, state: ckpt.Checkpoint) -> None:
        """Load ``state`` into the model, optimizer, generators and sampler. Collective.

        Touches no file. Raises ConfigError (the same on every rank: each reads the same
        file) when the checkpoint does not fit this configuration: another model, or
        another sample order; CheckpointError for a damaged part.
        """
        run, path = self.run, state.path
        try:  # each rank reads only what it holds, from any layout's checkpoint
            self.checkpointer.load(state)
        except LoadError as e:
            if e.kind == "model":
                raise another_model(path, run.config, "resume from", e) from None
            if e.kind == "optimizer":
                raise ConfigError(
                    f"cannot resume from {path}: its optimizer state does not fit the "
                    f"configured optimizer {run.config.optimizer!r} ({first_line(e)}); "
                    "resume with the optimizer it was saved with, or use another "
                    "--run-dir") from None
            raise ckpt.CheckpointError(str(e)) from None
        self.load_rng_states(state.rng, int(state.step))
        try:
            run.loader.load_state_dict(state.sampler)
        except ValueError as e:  # the same on every rank: each reads the same file
            raise ConfigError(f"cannot resume from {path}: {e} (in the config: --global-batch, "
                              "--seed, --data.shuffle, --data.block-size, the dataset)") from e

    def rng_states(self) -> dict[str, Any]:
        """The modules' generators (dropout) of every data rank. Collective.

        Each data rank draws as many masks as its share of a batch asks, so after an
        uneven batch their generators differ: all of them are saved (as ``per_rank``, by
        data rank: the ranks of one tensor x sequence group hold the same), so that a
        resume on as many data ranks continues bit for bit. While they agree, one is.
        """
        run = self.run
        mine = {name: m.rng.bit_generator.state for name, m in self.generators().items()}
        # A data rank's generators are those of its stages (one, without a pipeline),
        # alike on the tensor x sequence ranks of each.
        ranks: dict[str, dict] = {}
        for d, s in run.comm.allgather_obj((run.layout.data.rank, mine)):
            ranks.setdefault(str(d), {}).update(s)
        if all(s == ranks["0"] for s in ranks.values()):
            return ranks["0"]
        return {"per_rank": ranks}

    def generators(self) -> dict[str, Any]:
        """The modules with a dropout generator, by their single-rank model's names
        (a pipeline stage's parts renamed: a checkpoint names them alike in every
        layout). Not collective."""
        pipeline = self.run.layout.pipeline
        if pipeline is None:
            return {name: m for name, m in self.run.model.named_modules()
                    if isinstance(getattr(m, "rng", None), numpy.random.Generator)}
        return {single_rank_name(pipeline, name): m
                for name, m in pipeline.module.named_modules()
                if isinstance(getattr(m, "rng", None), numpy.random.Generator)}

    def load_rng_states(self, saved: dict[str, Any], step: int = 0) -> None:
        """Set the modules' generators from :meth:`rng_states` of a run at ``step``."""
        run = self.run
        data = run.layout.data
        states = saved.get("per_rank")
        other_count = states is not None and len(states) != data.size
        if states is not None:
            # Another number of data ranks splits batches otherwise anyway (equal up to
            # rounding, not bitwise): data rank 0 continues rank 0's generators, the
            # others get fresh ones of their own (seeded with the step, not reused masks).
            saved = states["0" if other_count else str(data.rank)]
        for name, m in self.generators().items():
            if name in saved:
                m.rng.bit_generator.state = saved[name]
        if other_count:
            model = run.model if run.layout.pipeline is None else run.layout.pipeline.module
            seed_dropout_per_rank(model, run.config.seed, data.rank, salt=step)

    def check_replicas(self, step: int) -> None:
        """Warn if the ranks' parameters are not bit-identical. Collective.

        Data parallelism keeps one model on every rank; a checkpoint holds rank 0's. A
        rank whose copy has drifted (a bug, or an MPI whose reductions differ between
        ranks) would be lost silently: a CRC-32 of every rank's parameters says so, at
        one small allgather per checkpoint.
        """
        run, layout = self.run, self.run.layout
        if run.config.zero:
            return  # each rank holds its own shard by design
        digest = 0
        for p in run.dp.parameters():  # the model's (a pipeline: this stage's)
            digest = zlib.crc32(numpy.ascontiguousarray(as_numpy(p.data)), digest)
        # Replicas of the same shards (the whole model under data parallelism).
        digests = layout.replicas.allgather_obj(digest)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ and layout.grid is not None:
            differ = [layout.grid.world_rank(*divmod(r, layout.plan.sequence),
                                             layout.grid.tensor_rank)
                      for r in differ]  # replica ranks are data x sequence (of a stage)
        if differ:
            self.log.info(f"warning: step {step}: the parameters of rank"
                          f"{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                          "differ from rank 0's (they should be identical under data "
                          "parallelism); the checkpoint holds rank 0's")


__all__ = ["RunCheckpoints"]
