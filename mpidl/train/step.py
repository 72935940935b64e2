"""One training step: the function ``mpidl train`` runs per batch and ``mpidl plan`` times.

:class:`TrainStep` takes a built run (:class:`~mpidl.train.build.Run`) and does one
optimizer step on this rank's share of a global batch: the objective's forward and
loss, backward through the wrapper (the gradient allreduce or reduce-scatter overlapped),
the finite-step guard, the float16 loss scale, clipping, and the optimizer at the
scheduled learning rate (:func:`learning_rate`). Call it on every rank with each
rank's share of the same batch::

    run = build_run(config, comm, data_dir)
    step = TrainStep(run)
    for i, (x, y, n) in enumerate(batches):
        result = step(x, y, n, i)          # collective

A step whose loss or gradient is not finite on any rank is skipped on every rank (the
ranks agree on it, together with the preemption flag, in one small allreduce after
backward); under the ``stop`` policy ``nonfinite_steps`` of them in a row raise
:class:`Diverged`, and parameters that are no longer finite raise it at once.

Gradient accumulation (``--microbatches m``): the step cuts this rank's share into
``m`` microbatches (:func:`~mpidl.comm.split_counts`: uneven when ``m`` does not divide
it, empty ones allowed, as every rank runs all ``m``, collective forwards included),
runs forward and backward of each in order, and reduces the gradients over the ranks
once, in the last backward (the wrapper's ``no_sync`` before it; ZeRO 2-3 hold no full
gradient and reduce-scatter every microbatch into their shards instead, m times the
communication). The loss stays a sum divided once by the global batch's count, counted
before the first forward, so every microbatch's backward is seeded alike and the step
equals the one-microbatch step up to the order of the float sums; the guard, the loss
scale, clipping and the optimizer run once per step. Models whose forward depends on
the batch (batch norm's statistics) see microbatches, not the share, as in PyTorch.

With pipeline stages (``--pipeline-parallel p``) the microbatches are the pipeline's:
the step hands the share to :meth:`~mpidl.parallel.PipelineModel.step`, whose schedule
runs them over the stages (the same split, the same seed ``scale / count``, the
gradients reduced once), and the guard, loss scale, clipping (over every stage) and
optimizer follow once, as above.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import numpy

from mpidl.backend import as_numpy
from mpidl.comm import split_counts
from mpidl.optim import (grad_norm, grads_finite, params_finite, unscale_, warmup_cosine,
                         warmup_linear)
from mpidl.train.build import Run
from mpidl.train.config import Config
from mpidl.train.log import Logger
from mpidl.train.noise import NoiseScale


class Diverged(RuntimeError):
    """The run cannot go on: too many non-finite steps in a row, or non-finite parameters."""


def scaled_dtype(params: Any) -> str:
    """The dtype name a skipped step's message gives: the parameters' 16-bit dtype (the
    backward that overflowed ran in it; their gradients may be kept in float32), else
    the first parameter's dtype (``--loss-scale=dynamic`` at fp32)."""
    names = [p.data.dtype.name for p in params]
    halves = [n for n in names if n in ("float16", "bfloat16")]
    return (halves or names or ["float32"])[0]


def learning_rate(config: Config, step: int, total: int) -> float:
    """The scheduled learning rate of optimizer step ``step`` (0-based) of ``total``."""
    base = config.scaled_lr()
    warmup = config.warmup_for(total)
    if config.schedule == "constant":
        return base if step >= warmup or warmup == 0 else base * (step + 1) / warmup
    fn = warmup_cosine if config.schedule == "cosine" else warmup_linear
    return fn(step, total, warmup, base, min_lr=config.min_lr_ratio * base)


@dataclasses.dataclass
class StepResult:
    """What one :class:`TrainStep` call returns.

    Attributes:
        loss: this rank's loss sum (an ``xp`` scalar: reading it syncs the device), 0
            for a skipped step.
        correct: this rank's correct count (``xp`` scalar), 0 for a skipped step.
        counted: the samples this rank counted, 0 for a skipped step.
        preempted: whether the preemption flag was set on any rank.
    """

    loss: Any
    correct: Any
    counted: int
    preempted: bool


def read_values(xp: Any, *values: Any) -> numpy.ndarray:
    """Device scalars (0-d xp arrays, or Python numbers) read to the host in one copy,
    as float64: the step's one host read besides the loss (#48)."""
    if xp is numpy:
        return numpy.array([float(v) for v in values])
    return as_numpy(xp.stack([xp.asarray(v, dtype=numpy.float64) for v in values]))


class _NoSignal:
    is_set = False


class TrainStep:
    """One optimizer step of ``run`` on a batch, or a skipped one. Callable, collective.

    Args:
        run: the run's parts (:func:`~mpidl.train.build.build_run`).
        log: where warnings go (rank 0 prints): a skipped step, an overflow.
        timer: a :class:`~mpidl.train.metrics.StepTimer` to which each step adds its
            communication wait, or None.
        last_checkpoint: names the last good checkpoint in a :class:`Diverged` message.

    Attributes:
        skipped_steps: non-finite (or overflowed) steps skipped so far; a resume sets it.
        nonfinite_in_a_row: the current run of non-finite steps.
    """

    def __init__(self, run: Run, log: Logger | None = None, timer: Any = None,
                 last_checkpoint: Callable[[], str] = lambda: "none written yet") -> None:
        self.run = run
        self.log = log if log is not None else Logger(run.comm.rank, run.comm.size)
        self.timer = timer
        self.last_checkpoint = last_checkpoint
        self.skipped_steps = 0
        self.nonfinite_in_a_row = 0
        self.pipeline_times = (0.0, 0.0)  # the last pipelined step's wait and wall seconds
        self.noise = NoiseScale()  # the gradient noise scale, where the run measures it
        self._counts = (0, 0)      # the last step's global and local target counts

    def __call__(self, x: Any, y: Any, n: int, step: int, flag: Any = None) -> StepResult:
        """Train on this rank's share ``x``, ``y`` (None for a language model) of a
        global batch of ``n`` samples as optimizer step ``step`` (0-based: its learning
        rate). Collective.

        ``flag`` (a :class:`~mpidl.train.signals.PreemptionFlag`, or None) is read when
        the ranks agree after backward: its ``is_set`` on any rank comes back as
        ``preempted``. After backward the ranks agree, in one allreduce, on the flag and
        on whether the step is finite everywhere (this rank's loss and the averaged
        gradients, which every rank holds alike); a non-finite step skips the update.
        """
        run = self.run
        flag = flag if flag is not None else _NoSignal
        loss_scale = run.loss_scale
        # Non-finite values are reported once per step by the guard below, not by NumPy's
        # warnings on every operation they pass through.
        scale = loss_scale.scale if loss_scale else 1.0
        with numpy.errstate(invalid="ignore", over="ignore", divide="ignore"):
            loss, counted, correct = self._accumulate(x, y, n, scale)
        params = run.dp.parameters()  # the model's, or this rank's shards (ZeRO)
        # Both verdicts, and the noise scale's two squared norms where it is measured,
        # in one host read (a read waits for the device: #48's budget).
        noise = ()
        if run.local_grads is not None:
            norm = run.dp.grad_norm() if run.config.zero else grad_norm(params)
            with numpy.errstate(over="ignore", invalid="ignore"):  # the guard speaks
                noise = (run.local_grads.take_raw(), 0.0 if norm is None else norm * norm)
        values = read_values(run.xp, run.xp.isfinite(loss), grads_finite(params), *noise)
        loss_finite, finite = bool(values[0]), bool(values[1]) and bool(values[0])
        preempted, nonfinite, bad_loss = run.comm.agree_each(
            flag.is_set, not finite, not loss_finite)
        if loss_scale is not None:
            if nonfinite and not bad_loss and not loss_scale.at_minimum:
                # Scaled 16-bit gradients overflowed: routine, not divergence.
                loss_scale.update(False)
                run.optimizer.zero_grad()
                self.skipped_steps += 1
                self.log.info(f"step {step + 1}: {scaled_dtype(params)} gradients "
                              f"overflowed at loss "
                              f"scale {scale:g}; step skipped, scale now "
                              f"{loss_scale.scale:g}")
                return StepResult(0, 0, 0, preempted)
            loss_scale.update(not nonfinite)
        if nonfinite:
            run.optimizer.zero_grad()
            self._nonfinite_step(finite, step)
            return StepResult(0, 0, 0, preempted)
        self.nonfinite_in_a_row = 0
        if loss_scale is not None:
            unscale_(params, loss_scale)
        if run.config.clip_grad_norm:
            run.layout.clip_grad_norm_(run.dp, run.config.clip_grad_norm)
        if run.local_grads is not None:  # the squares read above, scaled by the loss scale
            # A finite step's squares can still overflow (a diverging run): the noise scale
            # then has no value, and the non-finite guard, not NumPy, says what happened.
            with numpy.errstate(over="ignore", invalid="ignore", divide="ignore"):
                self._measure_noise(float(values[2]), float(values[3]) / scale ** 2, scale)
        run.optimizer.lr = learning_rate(run.config, step, run.total_steps)
        run.optimizer.step()
        run.optimizer.zero_grad()
        return StepResult(loss, correct, counted, preempted)

    def _accumulate(self, x: Any, y: Any, n: int, scale: float) -> tuple[Any, int, Any]:
        """Forward and backward of each microbatch of this rank's share, the gradients
        reduced over the ranks in the last backward. Collective. Returns this rank's loss
        sum (an xp scalar), its counted targets and its correct count."""
        run = self.run
        m = run.config.microbatches
        # The global count first: every microbatch's backward is seeded 1/count, so the
        # loss is divided once, by the whole batch's count (Megatron divides by m).
        if run.local_grads is not None:
            run.local_grads.take()  # a skipped step's norms are not this step's
        local = run.objective.targets(x, y)
        count = run.objective.global_count(run.comm, n, local)
        self._counts = (count, local)
        if run.layout.pipeline is not None:
            return self._pipelined(x, count, scale)
        loss_sum: Any = 0
        counted, correct, start = 0, 0, 0
        for i, rows in enumerate(split_counts(len(x), m)):
            last = i == m - 1
            part = slice(start, start + rows)
            start += rows
            waited_before = run.dp.comm_wait_start
            with contextlib.nullcontext() if last else run.dp.no_sync():
                loss, c, k = run.objective.step(run.dp, x[part],
                                                None if y is None else y[part], run.xp)
                run.dp.backward(loss, global_count=count, scale=scale)
            # A backward that did not communicate (data parallel's no_sync) leaves the
            # last wait in place: counting it again gave 2-rank gpt steps of 0.20 s a
            # 0.22 s "comm" and no compute at m = 3.
            if self.timer is not None and run.dp.comm_wait_start != waited_before:
                self.timer.add("comm", run.dp.comm_wait_seconds, start=run.dp.comm_wait_start)
            loss_sum = loss.data if i == 0 else loss_sum + loss.data
            counted += c
            correct = correct + k
        return loss_sum, counted, correct

    def _pipelined(self, x: Any, count: int, scale: float) -> tuple[Any, int, Any]:
        """The pipeline's step (:meth:`~mpidl.parallel.PipelineModel.step`): its schedule
        runs the ``m`` microbatches of ``x`` forward and backward over the stages, the
        gradients reduced over the stage's replicas once, seeded ``scale / count`` as
        the accumulation above. Collective over the world. The loss share and the
        next-token hits (the last stage counts them) are the same on every stage."""
        run = self.run
        pipeline = run.layout.pipeline
        loss_sum, _ = pipeline.step(x, global_count=count, scale=scale)
        # The bubble: the step's waits for activations and gradients from the
        # neighbouring stages, counted as communication (and kept for the records).
        self.pipeline_times = (pipeline.wait_seconds, pipeline.step_seconds)
        if self.timer is not None:
            now = time.perf_counter()
            self.timer.add("comm", pipeline.wait_seconds, start=now - pipeline.wait_seconds,
                           name="pipeline wait")
            if run.dp.comm_wait_seconds:  # the stage's gradient reduction, in its last backward
                self.timer.add("comm", run.dp.comm_wait_seconds, start=run.dp.comm_wait_start)
        loss = run.xp.asarray(loss_sum, dtype=numpy.float64)
        return loss, self._counts[1], pipeline.hits  # this rank's targets, counted once

    def _measure_noise(self, small: float, big: float, scale: float) -> None:
        """One step of the gradient noise scale (:mod:`mpidl.train.noise`) from two
        squared norms read with the finite check: ``small``, this rank's gradient from
        its hooks, ``big``, the averaged one (unscaled). Collective over the replicas:
        one allreduce of three numbers, host memory."""
        run = self.run
        count, local = self._counts
        # The local gradient was seeded scale / count: scale and global mean, undone.
        small = small * (count / (scale * local)) ** 2 if local else 0.0
        sums = numpy.array([small, 1.0 / local if local else 0.0, 1.0 if local else 0.0])
        run.layout.replicas.allreduce_(sums)
        if sums[2]:
            self.noise.update(sums[0] / sums[2], sums[1] / sums[2], big, count)

    def _nonfinite_step(self, finite_here: bool, step: int) -> None:
        """Handle a step skipped for a non-finite loss or gradient. Collective.

        Raises Diverged when the parameters themselves are no longer finite (skipping
        cannot help), or under the "stop" policy at ``nonfinite_steps`` in a row.
        """
        run, config = self.run, self.run.config
        self.skipped_steps += 1
        self.nonfinite_in_a_row += 1
        ranks = [r for r, ok in enumerate(run.comm.allgather_obj(finite_here)) if not ok]
        where = (f"the loss on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                 "is not finite" if ranks else
                 "the averaged gradients are not finite")
        shown = step + 1
        if run.comm.agree_each(not bool(params_finite(run.dp.parameters())))[0]:
            raise Diverged(f"step {shown}: the parameters are no longer finite (the last "
                           f"update overflowed); the last good checkpoint is "
                           f"{self.last_checkpoint()}. Lower --lr, or set --clip-grad-norm")
        limit = config.nonfinite_steps
        if config.nonfinite == "stop" and self.nonfinite_in_a_row >= limit:
            raise Diverged(
                f"{self.nonfinite_in_a_row} non-finite steps in a row (the last, step {shown}: "
                f"{where}): the run is diverging or the data holds NaN/inf. The last good "
                f"checkpoint is kept: {self.last_checkpoint()}. Lower --lr, set "
                "--clip-grad-norm, check the data, or allow more with --nonfinite-steps / "
                "--nonfinite=skip")
        until = (f"; stopping at {limit}: --nonfinite-steps"
                 if config.nonfinite == "stop" else "")
        self.log.info(f"warning: step {shown}: {where}; the step is skipped on every rank "
                      f"({self.nonfinite_in_a_row} in a row{until})")


__all__ = ["TrainStep", "StepResult", "Diverged", "learning_rate"]
