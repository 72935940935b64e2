"""The training loop of ``mpidl train``: steps, exact evaluation, checkpoints, records.

The pieces are separate: :mod:`mpidl.train.build` makes the run's parts from the
configuration, :mod:`mpidl.train.step` is one optimizer step (what ``mpidl plan``
times), :mod:`mpidl.train.checkpointing` saves and restores them, and
:mod:`mpidl.train.rundir` claims the run directory. :class:`Trainer` puts them together
and runs the loop: its cadence of evaluations and checkpoints, the records and the
summary.

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

A step whose loss or gradient is not finite on any rank is skipped on every rank
(:class:`~mpidl.train.step.TrainStep`); under the ``stop`` policy ``nonfinite_steps`` of them in a row end the run
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

from mpidl.backend import as_numpy, device_clock
from mpidl.train import checkpoint as ckpt
from mpidl.train.build import build_optimizer, build_run
from mpidl.train.checkpointing import RunCheckpoints
from mpidl.train.config import Config
from mpidl.train.evaluation import evaluate
from mpidl.train.log import Logger, ProgressBar, format_summary
from mpidl.train.memory import state_bytes
from mpidl.train.metrics import MetricsWriter, StepTimer, Throughput, read_metrics
from mpidl.train.objective import Evaluation
from mpidl.train.rundir import METRICS_FILE, TRACE_FILE, claim_run_dir
from mpidl.train.signals import EXIT_PREEMPTED, PreemptionFlag
from mpidl.train.step import Diverged, TrainStep, learning_rate
from mpidl.train.timeline import Timeline

EXIT_DIVERGED = 1

# Names that lived here before the split, for code that imported them from here.
__all__ = ["Trainer", "Diverged", "EXIT_DIVERGED", "build_optimizer", "learning_rate"]


class Trainer:
    """One training run, on every rank of ``comm``.

    Args:
        config: the resolved configuration.
        comm: the world communicator.
        run_dir: the run directory (the same path on every rank).
        data_dir: the dataset directory (with ``train/`` and ``test/`` splits).

    Attributes:
        run: the run's parts (:class:`~mpidl.train.build.Run`); ``model``, ``dp``,
            ``optimizer``, ``loader``, ``objective``, ``layout`` ... are its.
        train_step: the step the loop calls (:class:`~mpidl.train.step.TrainStep`).
        checkpoints: saving and restoring (:class:`~mpidl.train.checkpointing.RunCheckpoints`).
        step: optimizer steps done (resumed ones included).
    """

    def __init__(self, config: Config, comm: Any, run_dir: str, data_dir: str) -> None:
        self.config, self.comm, self.run_dir = config, comm, run_dir
        self.log = Logger(comm.rank, comm.size)
        self.run = run = build_run(config, comm, data_dir, self.log)
        self.xp, self.threads = run.xp, run.threads
        self.train_set, self.test_set = run.train_set, run.test_set
        self.objective, self.layout, self.model = run.objective, run.layout, run.model
        self.dp, self.optimizer, self.loss_scale = run.dp, run.optimizer, run.loss_scale
        self.loader, self.eval_loader = run.loader, run.eval_loader
        self.total_steps = run.total_steps
        self.checkpoints = RunCheckpoints(run, run_dir, self.log)
        self.step = 0
        # Loss sum, correct, samples since the last train record (xp scalars): their
        # host sync waits for the record.
        self.window: list = [0, 0, 0]
        # Opened by begin(): until a resume has succeeded, the run directory is untouched.
        self.metrics = MetricsWriter(os.path.join(run_dir, METRICS_FILE), enabled=False)
        self.timeline = Timeline(comm.rank, enabled=config.trace)
        # On a GPU, CUDA events time the steps (read a step later): no host sync per step.
        self.timer = StepTimer(timeline=self.timeline, clock=device_clock(self.xp))
        self.train_step = TrainStep(run, self.log, self.timer, self.checkpoints.last)
        self.resumed_from: ckpt.Checkpoint | None = None
        self.last_evaluation: Evaluation | None = None  # this run's latest, if any

    @property
    def skipped_steps(self) -> int:
        """Non-finite (or overflowed float16) steps skipped so far, resumed ones included."""
        return self.train_step.skipped_steps

    # -- checkpoints ----------------------------------------------------------------------
    def save(self) -> str | None:
        """Write a checkpoint of the current step (:meth:`RunCheckpoints.save
        <mpidl.train.checkpointing.RunCheckpoints.save>`). Collective.

        Not from non-finite parameters: then nothing is written or rotated (the last
        good checkpoint stays) and None is returned, with a warning.
        """
        def extra() -> dict[str, Any]:
            # The steps since the last train record, so a resumed run's first record
            # averages as many steps as the uninterrupted run's (all ranks' sums: any
            # rank count).
            window = [float(v) for v in self._window_totals(self.window)]
            return {"ranks": self.comm.size, "total_steps": self.total_steps,
                    "train_window": window, "skipped_steps": self.skipped_steps,
                    "loss_scale": self.loss_scale.state_dict() if self.loss_scale else None}

        return self.checkpoints.save(self.step, extra)

    def restore(self, state: ckpt.Checkpoint) -> None:
        """Load a checkpoint into the model, optimizer, generators and sampler, and the
        loop's counters. Collective.

        Touches no file. Raises ConfigError (the same on every rank: each reads the same
        file) when the checkpoint does not fit this configuration: another model, or
        another sample order.
        """
        self.checkpoints.restore(state)
        saved_window = state.extra.get("train_window")
        if saved_window is not None:  # all ranks' sums: on rank 0, once
            self.window = list(saved_window) if self.comm.rank == 0 else [0, 0, 0]
        self.train_step.skipped_steps = int(state.extra.get("skipped_steps", 0))
        if self.loss_scale is not None and state.extra.get("loss_scale"):
            self.loss_scale.load_state_dict(state.extra["loss_scale"])
        self.step = int(state.step)
        self.resumed_from = state

    def begin(self, config_text: str, corrupt: list[tuple[str, str]] = (),
              previous: bool = False) -> None:
        """Make the run directory this run's: the first change to it
        (:func:`~mpidl.train.rundir.claim_run_dir`, on rank 0). Then every rank opens
        the metrics. Collective."""
        notes, error = [], None
        if self.comm.rank == 0:
            try:
                notes = claim_run_dir(self.run_dir, config_text, self.step, self.train_set,
                                      corrupt, previous)
            except OSError as e:
                error = (f"cannot prepare the run directory {self.run_dir}: {e}; free space "
                         "or fix its permissions and run again")
        self.comm.check(error is None, str(error))
        for note in notes:
            self.log.info(note)
        self.metrics = MetricsWriter(self.metrics.path, enabled=self.comm.rank == 0)
        state = self.resumed_from
        if state is not None:
            self.log.info(f"resumed from {state.path} at step {self.step} "
                          f"(epoch {state.sampler['epoch']}, step {state.sampler['step']} of it; "
                          f"saved by {state.extra.get('ranks', '?')} ranks, now {self.comm.size})")

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
                        done = self.train_step(x, y, n, self.step, flag)
                        loss, correct, counted, preempted = (
                            done.loss, done.correct, done.counted, done.preempted)
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
        self.timeline.write(os.path.join(self.run_dir, TRACE_FILE), gather=comm.allgather_obj)
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
        self.last_evaluation = result
        self.metrics.write(kind="eval", epoch=epoch, step=self.step, **result.record)
        say(f"epoch {epoch}: {result.line}")

    def _window_totals(self, window: list) -> numpy.ndarray:
        """Loss sum, correct and samples of ``window`` over all ranks. Collective."""
        local = numpy.array([float(as_numpy(v)) for v in window])  # the one host sync
        self.objective.sum_totals(self.comm, local)
        return local

    def _state_bytes(self) -> dict[str, Any]:
        """Bytes every rank holds in parameters, gradients and optimizer state (lists by
        rank, for the metrics). Collective."""
        everyone = self.comm.allgather_obj(state_bytes(self.dp, self.optimizer))
        return {f"state_bytes_{k}": [e[k] for e in everyone] for k in everyone[0]}

    def _pipeline_fields(self) -> dict[str, Any]:
        """With pipeline stages, every rank's measured bubble of the last step (its waits
        for the neighbouring stages per second of work, ``wait / (step - wait)``; the
        schedule's ideal is ``(p - 1) / m``, over ``v`` interleaved) and the most bytes of
        activations it held for the next stage (lists by rank). Collective; {} without."""
        pipeline = self.layout.pipeline
        if pipeline is None:
            return {}
        wait, step = self.train_step.pipeline_times
        everyone = self.comm.allgather_obj(
            (wait / (step - wait) if step > wait else None, pipeline.peak_activation_bytes))
        return {"pipeline_bubble": [e[0] for e in everyone],
                "pipeline_activation_bytes": [e[1] for e in everyone]}

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
        record.update(self._pipeline_fields())
        if self.train_step.noise.value is not None:  # smoothed B_simple (mpidl.train.noise)
            record["noise_scale"] = self.train_step.noise.value
        if self.skipped_steps:
            record["skipped_steps"] = self.skipped_steps  # non-finite steps so far in all
        if self.loss_scale is not None:
            record["loss_scale"] = self.loss_scale.scale
        self.metrics.write(record)
        return record

    def _summary(self, seconds: float, steps: int) -> None:
        """Rank 0 prints the run's summary. Collective (the ranks' state sizes)."""
        held = self._state_bytes()
        pipeline = self._pipeline_fields()
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
            **({"pipeline (last step)": _describe_pipeline(pipeline)} if pipeline else {}),
            **({"non-finite steps skipped": self.skipped_steps} if self.skipped_steps else {}),
            "run directory": self.run_dir,
        }
        print("\n" + format_summary(records, totals), flush=True)


def _describe_pipeline(fields: dict[str, list]) -> str:
    """``bubble 0.21-0.35 (wait per second of work, by rank), activations for the next
    stage at most 0.5 MB``."""
    bubbles = [b for b in fields["pipeline_bubble"] if b is not None]
    spread = (f"{min(bubbles):.2f}-{max(bubbles):.2f}" if bubbles else "-")
    return (f"bubble {spread} (wait per second of work, over the ranks), activations "
            f"held for the next stage at most "
            f"{max(fields['pipeline_activation_bytes']) / 1e6:.3g} MB")


def _describe_state(held: dict[str, list[int]], zero: int, plan: Any = None) -> str:
    """``0.212 MB parameters, 0 MB gradients, 0.425 MB optimizer state (largest rank; ...)``."""
    parts = [f"{max(held[f'state_bytes_{k}']) / 1e6:.3g} MB {k}"
             for k in ("parameters", "gradients", "optimizer")]
    mode = f"ZeRO stage {zero}" if zero else "data parallel: every rank holds it all"
    if plan is not None and plan.split:
        mode = f"split over {plan.describe()}"
    return ", ".join(parts) + f" state (largest rank; {mode})"
