"""The training loop of ``mpidl train``: data-parallel steps, exact evaluation, checkpoints.

Every rank runs the same loop over its share of each global batch (the
:class:`~mpidl.data.DistributedSampler` fixes the global batches from seed and epoch,
whatever the number of ranks). Per step: input (prefetched), forward, backward with the
gradient allreduce overlapped (:class:`~mpidl.parallel.DataParallel`), optional
clipping, the optimizer step at the scheduled learning rate. Step time is split into
compute, communication wait and input wait for the metrics and the Chrome trace.

Resuming continues bit for bit: the checkpoint holds the parameters, the optimizer
state (with its step counts), the RNG states of dropout layers and the sampler position
(epoch, step), and every one of them is independent of the number of ranks, so a run
may also resume on a different number of ranks (then equal up to float summation order).

On SIGTERM or SIGUSR1 (Slurm's warning before a time limit or preemption; the job's
:class:`~mpidl.train.signals.PreemptionFlag`, given to :meth:`Trainer.fit`) all ranks
agree at the next step boundary, rank 0 writes a checkpoint, and :meth:`Trainer.fit`
returns :data:`~mpidl.train.signals.EXIT_PREEMPTED` (75) so a batch script can requeue.

A step whose loss or gradient is not finite on any rank is skipped on every rank (the
ranks agree on it together with the signal flag, in one small allreduce after
backward); under the ``stop`` policy ``nonfinite_steps`` of them in a row end the run
with status 1, and parameters that are no longer finite end it at once. A checkpoint is
never written from non-finite parameters.

The run directory changes only once a resume has succeeded (:meth:`Trainer.restore`
touches no file; :meth:`Trainer.begin` then writes ``config.toml``, trims
``metrics.jsonl`` and sets checkpoints aside), so a refused or failed resume leaves it
exactly as it was.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy

from hpc.files import write_text
from mpidl.train import checkpoint as ckpt
from mpidl.train.checkpointer import LoadError, choose_checkpointer
from mpidl.train.config import Config, ConfigError, to_toml
from mpidl.train.evaluation import evaluate, evaluation_loader
from mpidl.train.log import Logger, ProgressBar, format_summary
from mpidl.train.model import (another_model, build_model, first_line, load_model_state,
                               unscaled_note)
from mpidl.train.metrics import MetricsWriter, StepTimer, Throughput, read_metrics, trim_metrics
from mpidl.train.objective import Evaluation, objective_for
from mpidl.train.signals import EXIT_PREEMPTED, PreemptionFlag
from mpidl.train.timeline import Timeline

EXIT_DIVERGED = 1


class Diverged(RuntimeError):
    """The run cannot go on: too many non-finite steps in a row, or non-finite parameters."""


def _check_splits(train: Any, test: Any, needed: tuple[str, ...] = ("x", "y")) -> None:
    """What the trainer reads: features ``x`` (inputs) and ``y`` (labels; a language
    model reads ``x`` only), some samples."""
    for split in (train, test):
        missing = [name for name in needed if name not in split.features]
        if missing:
            what = " and ".join(f"{n!r}" for n in needed)
            raise ValueError(
                f"dataset {split.path} has features {sorted(split.features)}, but the "
                f"trainer reads {what}: write the split with those names "
                f"(missing: {', '.join(missing)})")
    if len(train) == 0:
        raise ValueError(f"dataset {train.path} has no samples: nothing to train on; "
                         f"write a non-empty train split")
    from mpidl.data.splits import check_splits_agree  # features, vocabulary, classes
    check_splits_agree({train.path: train.manifest, test.path: test.manifest})


def build_optimizer(config: Config, params: list) -> Any:
    from mpidl import optim

    lr = config.scaled_lr()
    if config.optimizer == "sgd":
        return optim.SGD(params, lr=lr, momentum=config.momentum,
                         weight_decay=config.weight_decay)
    cls = optim.AdamW if config.optimizer == "adamw" else optim.Adam
    return cls(params, lr=lr, weight_decay=config.weight_decay)


def learning_rate(config: Config, step: int, total: int) -> float:
    """The scheduled learning rate of optimizer step ``step`` (0-based) of ``total``."""
    from mpidl.optim import warmup_cosine, warmup_linear

    base = config.scaled_lr()
    warmup = config.warmup_for(total)
    if config.schedule == "constant":
        return base if step >= warmup or warmup == 0 else base * (step + 1) / warmup
    fn = warmup_cosine if config.schedule == "cosine" else warmup_linear
    return fn(step, total, warmup, base, min_lr=config.min_lr_ratio * base)


class Trainer:
    """One training run, on every rank of ``comm``.

    Args:
        config: the resolved configuration.
        comm: the world communicator.
        run_dir: the run directory (the same path on every rank).
        data_dir: the dataset directory (with ``train/`` and ``test/`` splits).
    """

    def __init__(self, config: Config, comm: Any, run_dir: str, data_dir: str) -> None:
        from mpidl.backend import get_xp
        from mpidl.data import DataLoader, DistributedSampler, ShardedDataset
        from mpidl.parallel import DataParallel, ShardedDataParallel

        self.config, self.comm, self.run_dir = config, comm, run_dir
        self.log = Logger(comm.rank, comm.size)
        self.xp = get_xp(config.backend)
        from mpidl.backend import limit_cpu_threads

        self.threads = limit_cpu_threads(comm.local_size)
        if config.backend == "cupy":
            from hpc.gpu import bind

            bind(comm.local_rank)
        self.train_set = ShardedDataset(os.path.join(data_dir, "train"), comm=comm)
        self.test_set = ShardedDataset(os.path.join(data_dir, "test"), comm=comm)
        self.objective = objective_for(config, self.train_set)
        # The same files: alike on every rank.
        _check_splits(self.train_set, self.test_set, self.objective.features)
        self._warn_if_one_class_dominates()
        note = unscaled_note(config, self.train_set)
        if note:
            self.log.info(note)
        model = build_model(config, self.train_set)
        # Where the model lives: whole on every rank, or split over a tensor x sequence
        # grid (mpidl.train.layout); an impossible layout is a ConfigError (exit 2).
        from mpidl.train.layout import Layout, plan_layout

        length = max(int(self.train_set.features["x"].shape[-1]) - 1, 1) \
            if config.task == "gpt" else 1
        self.layout = Layout(plan_layout(config, comm.size, model, length), comm)
        if self.layout.grid is not None:
            self.objective = self.objective.split_over(self.layout.grid)
            self.log.info(f"model layout: {self.layout.plan.describe()}")
        from mpidl.train.model import seed_dropout_per_rank

        # Before the split: the shards' dropout keeps the full model's generators, the
        # same on every rank of a replica, one of its own on every data rank.
        seed_dropout_per_rank(model, config.seed, self.layout.data.rank)
        self.model = self.layout.split_model(model).to(self.xp)
        del model
        replicas = self.layout.replicas  # gradients are averaged over these ranks
        dp_options = {} if config.bucket_mb is None else {"bucket_mb": config.bucket_mb}
        if config.sync_batchnorm and replicas.size > 1:
            from mpidl.parallel import convert_sync_batchnorm

            convert_sync_batchnorm(self.model, replicas)  # no-op without batch norm layers
        if config.zero:
            self.dp = ShardedDataParallel(self.model, replicas, stage=config.zero,
                                          keep_freed_memory=config.keep_freed_memory,
                                          **dp_options)
        else:
            self.dp = DataParallel(self.model, replicas, overlap=config.overlap,
                                   keep_freed_memory=config.keep_freed_memory, **dp_options)
        # What the optimizer updates: the model's parameters, or this rank's shards.
        self.optimizer = build_optimizer(config, self.dp.parameters())
        # How this layout saves and loads its share of the state, chosen once.
        self.checkpointer = choose_checkpointer(comm, self.layout, self.dp, self.model,
                                                self.optimizer)
        data = self.layout.data  # every rank of a tensor x sequence group reads the same
        sampler = DistributedSampler(len(self.train_set), config.global_batch, data.rank,
                                     data.size, seed=config.seed, shuffle=config.data.shuffle,
                                     block_size=config.data.block_size)
        self.loader = DataLoader(self.train_set, sampler, self.objective.features, xp=self.xp,
                                 prefetch=config.data.prefetch)
        self.eval_loader = evaluation_loader(self.test_set, data, self.xp,
                                             config.data.prefetch, self.objective.features)
        steps = config.epochs * len(self.loader)
        self.total_steps = min(steps, config.steps) if config.steps else steps
        self.step = 0
        # Loss sum, correct, samples since the last train record (xp scalars): their
        # host sync waits for the record.
        self.window: list = [0, 0, 0]
        # Opened by begin(): until a resume has succeeded, the run directory is untouched.
        self.metrics = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"), enabled=False)
        self.nonfinite_in_a_row = 0
        self.skipped_steps = 0
        # float16 parameters (--model.dtype=float16) train with a dynamic loss scale.
        from mpidl.optim import DynamicLossScale

        half = any(p.data.dtype == numpy.float16 for p in self.dp.parameters())
        self.loss_scale = DynamicLossScale() if half else None
        self.timeline = Timeline(comm.rank, enabled=config.trace)
        # On a GPU, CUDA events time the steps (read a step later): no host sync per step.
        from mpidl.backend import device_clock

        self.timer = StepTimer(timeline=self.timeline, clock=device_clock(self.xp))

    def _warn_if_one_class_dominates(self) -> None:
        """Say so when always guessing one class scores high: the accuracy to beat.

        "Dominates": more than halfway from a balanced share to all of them (75% of 2
        classes, 55% of 10), where a high accuracy stops meaning the model learned.
        """
        from mpidl.data.stats import majority

        found = majority(self.train_set.manifest)
        classes = self.train_set.num_classes or 0
        if found is None or classes < 2:
            return
        name, share = found
        if share >= 0.5 + 0.5 / classes:
            self.log.info(f"warning: one class dominates the training data: {name!r} is "
                          f"{share:.0%} of {self.train_set.path}; always guessing it scores "
                          f"{share:.2f}, the accuracy a model must beat")

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.run_dir, ckpt.CHECKPOINT_DIR)

    def _rng_states(self) -> dict[str, Any]:
        """The modules' generators (dropout) of every data rank. Collective.

        Each data rank draws as many masks as its share of a batch asks, so after an
        uneven batch their generators differ: all of them are saved (as ``per_rank``, by
        data rank: the ranks of one tensor x sequence group hold the same), so that a
        resume on as many data ranks continues bit for bit. While they agree, one is.
        """
        mine = {name: m.rng.bit_generator.state for name, m in self.model.named_modules()
                if isinstance(getattr(m, "rng", None), numpy.random.Generator)}
        everyone = self.comm.allgather_obj((self.layout.data.rank, mine))
        if all(s == mine for _, s in everyone):
            return mine
        return {"per_rank": {str(d): s for d, s in everyone}}

    def _load_rng_states(self, saved: dict[str, Any], step: int = 0) -> None:
        data = self.layout.data
        states = saved.get("per_rank")
        other_count = states is not None and len(states) != data.size
        if states is not None:
            # Another number of data ranks splits batches otherwise anyway (equal up to
            # rounding, not bitwise): data rank 0 continues rank 0's generators, the
            # others get fresh ones of their own (seeded with the step, not reused masks).
            saved = states["0" if other_count else str(data.rank)]
        for name, m in self.model.named_modules():
            if name in saved:
                m.rng.bit_generator.state = saved[name]
        if other_count:
            from mpidl.train.model import seed_dropout_per_rank

            seed_dropout_per_rank(self.model, self.config.seed, data.rank, salt=step)

    def save(self) -> str | None:
        """Write a checkpoint of the current step: every rank its part, rank 0 the index
        (:mod:`mpidl.train.checkpointer`). Collective.

        Not from non-finite parameters: then nothing is written or rotated (the last
        good checkpoint stays) and None is returned, with a warning.
        """
        from mpidl.comm.ledger import patience
        from mpidl.optim import params_finite

        path = None
        error = None
        if self.comm.agree_each(not bool(params_finite(self.dp.parameters())))[0]:
            self.log.info(f"warning: no checkpoint at step {self.step}: the parameters are not "
                          f"finite; the last good one is kept ({self._last_checkpoint()})")
            return None
        self._check_replicas()
        rng = self._rng_states()
        # The steps since the last train record, so a resumed run's first record averages
        # as many steps as the uninterrupted run's (all ranks' sums: any rank count).
        window = [float(v) for v in self._window_totals(self.window)]
        extra = {"ranks": self.comm.size, "total_steps": self.total_steps,
                 "train_window": window, "skipped_steps": self.skipped_steps,
                 "loss_scale": self.loss_scale.state_dict() if self.loss_scale else None}
        # Every rank writes its own part of the state (nobody gathers it), then rank 0
        # the index; an index on disk means all its parts are.
        try:
            path = self.checkpointer.save(
                self.checkpoint_dir, self.step, rng=rng, sampler=self.loader.state_dict(),
                config=to_toml(self.config), epoch=self.loader.state_dict()["epoch"],
                extra=extra)
            if self.comm.rank == 0:
                ckpt.keep_last(self.checkpoint_dir, self.config.keep_checkpoints)
        except OSError as e:
            error = f"cannot remove old checkpoints in {self.checkpoint_dir}: {e}"
        with patience("rank 0 removes old checkpoints"):
            self.comm.check(error is None, str(error))
        return path

    def _state_bytes(self) -> dict[str, Any]:
        """Bytes every rank holds in parameters, gradients and optimizer state (lists by
        rank, for the metrics). Collective."""
        from mpidl.train.memory import state_bytes

        everyone = self.comm.allgather_obj(state_bytes(self.dp, self.optimizer))
        return {f"state_bytes_{k}": [e[k] for e in everyone] for k in everyone[0]}

    def _check_replicas(self) -> None:
        """Warn if the ranks' parameters are not bit-identical. Collective.

        Data parallelism keeps one model on every rank; a checkpoint holds rank 0's. A
        rank whose copy has drifted (a bug, or an MPI whose reductions differ between
        ranks) would be lost silently: a CRC-32 of every rank's parameters says so, at
        one small allgather per checkpoint.
        """
        import zlib

        from mpidl.backend import as_numpy

        if self.config.zero:
            return  # each rank holds its own shard by design
        digest = 0
        for p in self.model.parameters():
            digest = zlib.crc32(numpy.ascontiguousarray(as_numpy(p.data)), digest)
        # Replicas of the same shards (the whole model under data parallelism).
        digests = self.layout.replicas.allgather_obj(digest)
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ and self.layout.grid is not None:
            differ = [self.layout.grid.world_rank(*divmod(r, self.layout.plan.sequence),
                                                  self.layout.grid.tensor_rank)
                      for r in differ]  # replica ranks are data x sequence
        if differ:
            self.log.info(f"warning: step {self.step}: the parameters of rank"
                          f"{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                          "differ from rank 0's (they should be identical under data "
                          "parallelism); the checkpoint holds rank 0's")

    def _last_checkpoint(self) -> str:
        listed = ckpt.listed_checkpoints(self.checkpoint_dir)
        return listed[-1] if listed else "none written yet"

    def restore(self, state: ckpt.Checkpoint) -> None:
        """Load a checkpoint into the model, optimizer, generators and sampler. Collective.

        Touches no file. Raises ConfigError (the same on every rank: each reads the same
        file) when the checkpoint does not fit this configuration: another model, or
        another sample order.
        """
        path = state.path
        try:  # each rank reads only what it holds, from any layout's checkpoint
            self.checkpointer.load(state)
        except LoadError as e:
            if e.kind == "model":
                raise another_model(path, self.config, "resume from", e) from None
            if e.kind == "optimizer":
                raise ConfigError(
                    f"cannot resume from {path}: its optimizer state does not fit the "
                    f"configured optimizer {self.config.optimizer!r} ({first_line(e)}); "
                    "resume with the optimizer it was saved with, or use another "
                    "--run-dir") from None
            raise ckpt.CheckpointError(str(e)) from None
        self._load_rng_states(state.rng, int(state.step))
        try:
            self.loader.load_state_dict(state.sampler)
        except ValueError as e:  # the same on every rank: each reads the same file
            raise ConfigError(f"cannot resume from {path}: {e} (in the config: --global-batch, "
                              "--seed, --data.shuffle, --data.block-size, the dataset)") from e
        saved_window = state.extra.get("train_window")
        if saved_window is not None:  # all ranks' sums: on rank 0, once
            self.window = list(saved_window) if self.comm.rank == 0 else [0, 0, 0]
        self.skipped_steps = int(state.extra.get("skipped_steps", 0))
        if self.loss_scale is not None and state.extra.get("loss_scale"):
            self.loss_scale.load_state_dict(state.extra["loss_scale"])
        self.step = int(state.step)
        self.resumed_from = state

    def begin(self, config_text: str, corrupt: list[tuple[str, str]] = (),
              previous: bool = False) -> None:
        """Make the run directory this run's: the first change to it. Collective.

        Rank 0, in an order where a failure (a full disk) leaves what it had not done
        yet as it was: trims ``metrics.jsonl`` to the resumed step (0 for a fresh
        start: records of a job that died before its first checkpoint), writes
        ``config.toml``, moves checkpoints that failed to load into ``corrupt/``, and
        moves newer checkpoints of another branch aside. With ``previous`` (a fresh
        start by ``--resume=never``) the old checkpoints, metrics and config first move
        to ``RUN_DIR/previous-<time>/``. Then every rank opens the metrics.
        """
        from mpidl.data.description import write_description

        notes, error = [], None
        if self.comm.rank == 0:
            try:
                notes = self._claim_run_dir(config_text, corrupt, previous)
                # What predicting needs of the data once it is gone (mpidl.data.description).
                write_description(os.path.join(self.run_dir, ckpt.DATASET_FILE),
                                  self.train_set.manifest, self.train_set.path)
            except OSError as e:
                error = (f"cannot prepare the run directory {self.run_dir}: {e}; free space "
                         "or fix its permissions and run again")
        self.comm.check(error is None, str(error))
        for note in notes:
            self.log.info(note)
        self.metrics = MetricsWriter(self.metrics.path, enabled=self.comm.rank == 0)
        state = getattr(self, "resumed_from", None)
        if state is not None:
            self.log.info(f"resumed from {state.path} at step {self.step} "
                          f"(epoch {state.sampler['epoch']}, step {state.sampler['step']} of it; "
                          f"saved by {state.extra.get('ranks', '?')} ranks, now {self.comm.size})")

    def _claim_run_dir(self, config_text: str, corrupt: list[tuple[str, str]],
                       previous: bool) -> list[str]:
        notes = []
        os.makedirs(self.run_dir, exist_ok=True)
        if previous:
            aside = ckpt.set_aside_run(self.run_dir)
            if aside:
                notes.append(f"--resume=never: the previous checkpoints and metrics of this "
                             f"run directory moved to {aside}")
        trim_metrics(self.metrics.path, self.step)
        write_text(os.path.join(self.run_dir, "config.toml"), config_text)
        for (path, reason), moved in zip(corrupt, ckpt.set_aside_corrupt(
                [p for p, _ in corrupt])):
            notes.append(f"warning: {reason}; moved to {moved}")
        aside = ckpt.set_aside_after(self.checkpoint_dir, self.step)
        if aside:
            notes.append(f"checkpoints after step {self.step} (another branch of this run) "
                         f"moved to {aside}")
        return notes

    # -- evaluation -----------------------------------------------------------------------
    def evaluate(self) -> Evaluation:
        """Exact scores over the whole test split, the objective's (classification:
        :class:`~mpidl.data.evaluate.Scores`: loss, accuracy, recall, macro-F1,
        majority-class accuracy; a language model: loss, perplexity, next-token
        accuracy; :func:`~mpidl.train.evaluation.evaluate`). Collective."""
        if self.config.zero:
            self.dp.gather_parameters()  # stages 1-2: the latest step's parameters
        return evaluate(self.objective, self.model, self.eval_loader, self.comm)

    # -- training -------------------------------------------------------------------------
    def _train_step(self, x: Any, y: Any, n: int, flag: PreemptionFlag
                    ) -> tuple[Any, Any, int, bool]:
        """One optimizer step, or a skipped one. Returns this rank's loss sum, correct
        count (xp scalars) and samples counted (0 for a skipped step), and whether a
        signal arrived on any rank. Collective.

        After backward the ranks agree, in one allreduce, on the signal flag and on
        whether the step is finite everywhere (this rank's loss and the averaged
        gradients, which every rank holds alike); a non-finite step skips the update.
        """
        from mpidl.optim import grads_finite

        # Non-finite values are reported once per step by the guard below, not by NumPy's
        # warnings on every operation they pass through.
        scale = self.loss_scale.scale if self.loss_scale else 1.0
        with numpy.errstate(invalid="ignore", over="ignore", divide="ignore"):
            loss, counted, correct = self.objective.step(self.dp, x, y, self.xp)
            count = self.objective.global_count(self.comm, n, counted)
            self.dp.backward(loss, global_count=count, scale=scale)
        self.timer.add("comm", self.dp.comm_wait_seconds, start=self.dp.comm_wait_start)
        params = self.dp.parameters()  # the model's, or this rank's shards (ZeRO)
        loss_finite = bool(self.xp.isfinite(loss.data))
        finite = loss_finite and bool(grads_finite(params))
        preempted, nonfinite, bad_loss = self.comm.agree_each(
            flag.is_set, not finite, not loss_finite)
        if self.loss_scale is not None:
            if nonfinite and not bad_loss and not self.loss_scale.at_minimum:
                # Scaled float16 gradients overflowed: routine, not divergence.
                self.loss_scale.update(False)
                self.optimizer.zero_grad()
                self.skipped_steps += 1
                self.log.info(f"step {self.step + 1}: float16 gradients overflowed at loss "
                              f"scale {scale:g}; step skipped, scale now "
                              f"{self.loss_scale.scale:g}")
                return 0, 0, 0, preempted
            self.loss_scale.update(not nonfinite)
        if nonfinite:
            self.optimizer.zero_grad()
            self._nonfinite_step(finite)
            return 0, 0, 0, preempted
        self.nonfinite_in_a_row = 0
        if self.loss_scale is not None:
            from mpidl.optim import unscale_

            unscale_(params, self.loss_scale)
        if self.config.clip_grad_norm:
            self.layout.clip_grad_norm_(self.dp, self.config.clip_grad_norm)  # global norm
        self.optimizer.lr = learning_rate(self.config, self.step, self.total_steps)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.data, correct, counted, preempted

    def _nonfinite_step(self, finite_here: bool) -> None:
        """Handle a step skipped for a non-finite loss or gradient. Collective.

        Raises Diverged when the parameters themselves are no longer finite (skipping
        cannot help), or under the "stop" policy at ``nonfinite_steps`` in a row.
        """
        from mpidl.optim import params_finite

        self.skipped_steps += 1
        self.nonfinite_in_a_row += 1
        ranks = [r for r, ok in enumerate(self.comm.allgather_obj(finite_here)) if not ok]
        where = (f"the loss on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                 "is not finite" if ranks else
                 "the averaged gradients are not finite")
        step = self.step + 1
        if self.comm.agree_each(not bool(params_finite(self.dp.parameters())))[0]:
            raise Diverged(f"step {step}: the parameters are no longer finite (the last update "
                           f"overflowed); the last good checkpoint is {self._last_checkpoint()}. "
                           "Lower --lr, or set --clip-grad-norm")
        limit = self.config.nonfinite_steps
        if self.config.nonfinite == "stop" and self.nonfinite_in_a_row >= limit:
            raise Diverged(
                f"{self.nonfinite_in_a_row} non-finite steps in a row (the last, step {step}: "
                f"{where}): the run is diverging or the data holds NaN/inf. The last good "
                f"checkpoint is kept: {self._last_checkpoint()}. Lower --lr, set "
                "--clip-grad-norm, check the data, or allow more with --nonfinite-steps / "
                "--nonfinite=skip")
        until = (f"; stopping at {limit}: --nonfinite-steps"
                 if self.config.nonfinite == "stop" else "")
        self.log.info(f"warning: step {step}: {where}; the step is skipped on every rank "
                      f"({self.nonfinite_in_a_row} in a row{until})")

    def fit(self, preempt: PreemptionFlag | None = None) -> int:
        """Train to the end (or to a preemption). Returns the process exit code. Collective.

        Args:
            preempt: the job's flag (``mpidl train`` installs the handlers at its start).
                None: this call installs no signal handler, and nothing preempts it.
        """
        flag = preempt if preempt is not None else PreemptionFlag(None)
        cfg, comm = self.config, self.comm
        bar = ProgressBar(self.total_steps, enabled=comm.rank == 0, mode=cfg.progress,
                          initial=self.step)
        rate = Throughput(window=cfg.log_every)
        comm.barrier()
        self.timeline.reset_origin()
        t_start = time.perf_counter()
        start_step = self.step
        preempted, eval_due = False, False
        stop = min(self.total_steps, cfg.stop_at_step or self.total_steps)
        try:
            while self.step < stop and not preempted:
                epoch = self.loader.state_dict()["epoch"]
                self.loader.set_epoch(epoch)
                batches = iter(self.loader)
                while True:
                    start = time.perf_counter()
                    batch = next(batches, None)  # waits only if the prefetch fell behind
                    if batch is None:
                        break
                    x, y, n = batch[0], batch[1] if len(batch) > 2 else None, batch[-1]
                    with self.timer.step(start=start):
                        self.timer.add("input", time.perf_counter() - start, start=start)
                        loss, correct, counted, preempted = self._train_step(x, y, n, flag)
                    self.step += 1
                    w = self.window
                    self.window = [w[0] + loss, w[1] + correct, w[2] + counted]
                    if self.timer.last is not None:  # a device clock's lags a step
                        rate.update(n, self.timer.last.total)
                    if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                        rec = self._record_train(self.window, rate, epoch)
                        self.window = [0, 0, 0]
                        shown = {"acc": rec["accuracy"]} if "accuracy" in rec else {}
                        bar.update(1, loss=rec["loss"], **shown)
                    else:
                        bar.update(1)
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        self.save()
                    if preempted:
                        break
                    if self.step >= stop:
                        break
                batches.close()  # stop the prefetch thread of an epoch left early
                epoch_done = self.loader.state_dict()["step"] == 0
                last = self.step >= self.total_steps
                eval_due = last or (epoch_done and (epoch + 1) % cfg.eval_every == 0)
                if preempted:
                    break  # the checkpoint first, then any evaluation due (below)
                if eval_due:
                    self._evaluate_epoch(epoch, bar.write)
                if last or (epoch_done and cfg.checkpoint_epochs) or self.step == stop:
                    self.save()
        except Diverged as e:
            batches.close()
            bar.close()
            self.metrics.write(kind="stop", step=self.step, reason=str(e),
                               skipped_steps=self.skipped_steps)
            self.metrics.close()
            if comm.rank == 0:
                print(f"mpidl train: error: {e}", file=sys.stderr, flush=True)
            return EXIT_DIVERGED
        bar.close()
        seconds = time.perf_counter() - t_start
        if preempted:
            path = self.save()
            self.log.info(f"preempted ({flag.signal_name or 'signal on another rank'}): checkpoint "
                          f"{path} at step {self.step}; exiting with {EXIT_PREEMPTED} to be "
                          "requeued")
            if eval_due:
                # The preempted step ended an epoch: its evaluation would be lost (the
                # checkpoint resumes in the next epoch), so it runs now, after the
                # checkpoint that must survive the preemption's grace period.
                self._evaluate_epoch(epoch, self.log.info)
        self.timeline.write(os.path.join(self.run_dir, "trace.json"), gather=comm.allgather_obj)
        self.metrics.close()
        if not preempted:
            self._summary(seconds, self.step - start_step)
        if self.step < self.total_steps and not preempted:
            self.log.info(f"stopped at step {self.step} of {self.total_steps} (stop_at_step); "
                          "run the same command again to continue")
        return EXIT_PREEMPTED if preempted else 0

    def _evaluate_epoch(self, epoch: int, say: Any) -> None:
        """Evaluate on the test split, record it and ``say`` it. Collective."""
        result = self.evaluate()
        self.metrics.write(kind="eval", epoch=epoch, step=self.step, **result.record)
        say(f"epoch {epoch}: {result.line}")

    def _window_totals(self, window: list) -> numpy.ndarray:
        """Loss sum, correct and samples of ``window`` over all ranks. Collective."""
        from mpidl.backend import as_numpy

        local = numpy.array([float(as_numpy(v)) for v in window])  # the one host sync
        self.objective.sum_totals(self.comm, local)
        return local

    def _record_train(self, window: list, rate: Throughput, epoch: int) -> dict[str, Any]:
        """Write a train record of the steps since the last one. Collective."""
        totals = self._window_totals(window)
        times = self.timer.last.as_record() if self.timer.last else {}
        # No sample counted: every step of the window was skipped (not finite). Its loss
        # and accuracy are undefined, null in the record, not 0.
        counted = totals[2] > 0
        loss = totals[0] / totals[2] if counted else None
        record = dict(kind="train", epoch=epoch, step=self.step, loss=loss,
                      **({"accuracy": totals[1] / totals[2] if counted else None}
                         if self.objective.accuracy else {}),
                      **(self.objective.extra(loss) if counted
                         else dict.fromkeys(self.objective.extra(0.0))),
                      lr=self.optimizer.lr, samples_per_s=rate.rate, **times)
        record.update(self._state_bytes())
        if self.skipped_steps:
            record["skipped_steps"] = self.skipped_steps  # non-finite steps so far in all
        if self.loss_scale is not None:
            record["loss_scale"] = self.loss_scale.scale
        self.metrics.write(record)
        return record

    def _summary(self, seconds: float, steps: int) -> None:
        """Rank 0 prints the run's summary. Collective (the ranks' state sizes)."""
        held = self._state_bytes()
        if self.comm.rank != 0:
            return
        mean = self.timer.mean()
        records = read_metrics(self.metrics.path)
        evals = [r for r in records if r.get("kind") == "eval"]
        totals = {
            "ranks": self.comm.size,
            "BLAS threads per rank": self.threads or "as set by OMP_NUM_THREADS / default",
            "steps": f"{steps} this run, {self.step} in all",
            "wall time": f"{seconds:.1f} s",
            "samples/s": steps * self.config.global_batch / seconds if seconds else 0.0,
            "step time": f"{mean.total * 1e3:.1f} ms (compute {mean.compute * 1e3:.1f}, "
                         f"comm wait {mean.comm * 1e3:.1f}, input wait {mean.input * 1e3:.1f})",
            **{f"final {label}": evals[-1].get(key, "-") if evals else "-"
               for key, label in self.objective.final_scores},
            "model state per rank": _describe_state(held, self.config.zero, self.layout.plan),
            **({"non-finite steps skipped": self.skipped_steps} if self.skipped_steps else {}),
            "run directory": self.run_dir,
        }
        print("\n" + format_summary(records, totals), flush=True)


def _describe_state(held: dict[str, list[int]], zero: int, plan: Any = None) -> str:
    """``0.212 MB parameters, 0 MB gradients, 0.425 MB optimizer state (largest rank; ...)``."""
    parts = [f"{max(held[f'state_bytes_{k}']) / 1e6:.3g} MB {k}"
             for k in ("parameters", "gradients", "optimizer")]
    mode = f"ZeRO stage {zero}" if zero else "data parallel: every rank holds it all"
    if plan is not None and plan.split:
        mode = f"split over {plan.describe()}"
    return ", ".join(parts) + f" state (largest rank; {mode})"
