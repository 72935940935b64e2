"""Where a run's model lives: whole on every rank, or split over a tensor x sequence grid.

``mpidl train gpt --tensor-parallel k --sequence-parallel ulysses|ring
--sequence-parallel-size s`` splits the world into a :class:`~mpidl.parallel.ProcessGrid`
(data = ranks / (k s)): each layer over the ``k`` ranks of a tensor group, each sequence
over the ``s`` ranks of a sequence group, and data parallelism over the rest. Without
those options the grid is 1 x 1 and the run is plain data parallelism (or ZeRO).

:func:`plan_layout` checks a layout against the world and the model before anything is
built, so an impossible one is a :class:`~mpidl.train.config.ConfigError` (exit 2) on
every rank (the same config, the same sizes: the same verdict) that says what would
work. The splits themselves are uneven where they can be (heads, vocabulary and
sequence are split into near-equal parts), so only what cannot be split is refused:

- ``k x s`` must divide the number of ranks;
- a tensor group cannot be larger than the model's heads or vocabulary (a rank would
  hold nothing);
- Ulysses gives every rank of a sequence group whole heads, so ``s`` must divide each
  tensor rank's heads (ring attention has no such rule);
- the sequence group cannot be longer than the sequence (a rank would hold no token).

``--pipeline-parallel p`` adds the outermost axis: the gpt model's layers in ``p`` stages
(:func:`~mpidl.parallel.pipeline_gpt.pipeline_model`), each stage the tensor x sequence
x data grid above over ``ranks / p`` ranks, each step's share run as ``--microbatches``
by the ``--pipeline-schedule``. Refused with what works: a schedule that cannot run
them (:func:`~mpidl.parallel.pipeline_schedule.check_layout`: fewer microbatches than
stages, interleaving without a multiple of ``p``), more model chunks (``p x
--virtual-stages``) than layers, ``--zero=3``, and any task or model but gpt.

:class:`Layout` then gives the trainer the communicators each job runs over: samples are
split over :attr:`Layout.data`, gradients averaged over :attr:`Layout.replicas` (data x
sequence: the sequence ranks' loss shares add up). A checkpoint holds the single-rank
parameters under their own names, each rank writing and reading only its elements
(:mod:`mpidl.train.checkpointer`), so a run resumes at any layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpidl.comm.base import split_counts
from mpidl.models.gpt import GPT
from mpidl.parallel import ParallelGPT, PipelineModel, ProcessGrid
from mpidl.parallel.pipeline_gpt import pipeline_model, stage_keeps
from mpidl.parallel.pipeline_schedule import check_layout as check_schedule
from mpidl.parallel.pipeline_schedule import flags_problem as schedule_flags_problem
from mpidl.optim.layerwise import TensorNorms
from mpidl.parallel.tensor import clip_grad_norm_ as clip_tensor_parallel_grad_norm_
from mpidl.parallel.sequence import ulysses_heads_fit
from mpidl.train.config import Config, ConfigError


@dataclass(frozen=True)
class LayoutPlan:
    """Sizes of the grid: ``tensor x sequence`` per model replica, ``data`` replicas."""

    tensor: int = 1
    sequence: int = 1
    data: int = 1
    attention: str = "none"          # "ulysses" | "ring" when ``sequence > 1``
    megatron: bool = False           # Megatron's sequence parallelism in the tensor group
    zero: int = 0                    # the ZeRO stage over the replicas (0: none)
    pipeline: int = 1                # stages (the outermost axis)
    schedule: str = "1f1b"           # the pipeline's (gpipe | 1f1b | interleaved)
    virtual: int = 1                 # model chunks per stage (interleaved)
    microbatches: int = 1            # per step, run by the pipeline's schedule

    @property
    def split(self) -> bool:
        """Whether the model is split at all (else: data parallelism, the trainer's own)."""
        return self.tensor * self.sequence * self.pipeline > 1

    def describe(self) -> str:
        parts = [f"data {self.data} x tensor {self.tensor} x sequence {self.sequence}"]
        if self.pipeline > 1:
            parts = [f"pipeline {self.pipeline} x {parts[0]}",
                     f"{self.schedule} schedule over {self.microbatches} microbatches"
                     + (f", {self.virtual} chunks per stage" if self.virtual > 1 else "")]
        if self.sequence > 1:
            parts.append(f"{self.attention} attention")
        if self.megatron:
            parts.append("Megatron sequence parallelism")
        if self.zero:
            parts.append(f"ZeRO stage {self.zero} over the replicas")
        return ", ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _list(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


def plan_layout(config: Config, ranks: int, model: Any, length: int) -> LayoutPlan:
    """The grid of ``config`` for ``ranks`` ranks and the single-rank ``model`` reading
    sequences of ``length`` tokens; ConfigError saying what would work when impossible."""
    k, mode, s = config.tensor_parallel, config.sequence_parallel, config.sequence_parallel_size
    p = config.pipeline_parallel
    if p > 1:
        ranks = _check_pipeline(config, ranks, model)  # the ranks of one stage
    elif config.virtual_stages > 1 or config.pipeline_schedule == "interleaved":
        raise ConfigError(f"--pipeline-schedule={config.pipeline_schedule} --virtual-stages="
                          f"{config.virtual_stages}: model chunks interleave over pipeline "
                          "stages; add --pipeline-parallel=2 or more")
    if mode == "none":
        if s not in (None, 1):
            raise ConfigError(f"--sequence-parallel-size={s} needs a way to split the "
                              "sequence: add --sequence-parallel=ulysses or "
                              "--sequence-parallel=ring")
        s = 1
    elif s is None:
        s = ranks // k if ranks % k == 0 else 0  # all the ranks the tensor split leaves
    if config.megatron_sequence_parallel and k == 1:
        raise ConfigError("--megatron-sequence-parallel splits the LayerNorm and dropout "
                          "regions within a tensor group: it needs --tensor-parallel >= 2")
    if k == 1 and s == 1:
        return LayoutPlan(data=ranks, attention=mode, zero=config.zero if p > 1 else 0,
                          **_pipeline_fields(config))
    if not isinstance(model, GPT):
        raise ConfigError(f"--tensor-parallel and --sequence-parallel split the gpt model; "
                          f"this run's model is {config.model.name!r}: use `mpidl train gpt` "
                          "(or --model=gpt), or data parallelism (--zero for memory)")
    if s == 0 or ranks % (k * s):
        fits = [d for d in _divisors(ranks) if d % k == 0] if ranks % k == 0 else []
        what = (f"--tensor-parallel={k} x --sequence-parallel-size={s} = {k * s}"
                if s else f"--tensor-parallel={k}")
        raise ConfigError(
            f"{what} does not divide the {ranks} ranks of this job; tensor x sequence must "
            f"divide them (the data axis gets the rest): products that do: "
            f"{_list(_divisors(ranks))}"
            + (f" (sequence sizes with --tensor-parallel={k}: "
               f"{_list([d // k for d in fits])})" if k > 1 else ""))
    heads = model.blocks[0].self_attn.heads if len(model.blocks) else 1
    limit = min(heads, model.vocab)
    if k > limit:
        raise ConfigError(
            f"--tensor-parallel={k}: the gpt model has {heads} heads and a vocabulary of "
            f"{model.vocab}, and every tensor rank needs at least one of each: use at most "
            f"{limit} tensor ranks (--model.heads sets the heads)")
    if s > length:
        raise ConfigError(
            f"--sequence-parallel-size={s}: the sequences have {length} tokens (the model "
            f"reads {length} of each {length + 1}-token row), fewer than the ranks of a "
            f"sequence group; use at most {length} sequence ranks, or longer sequences")
    if mode == "ulysses" and not ulysses_heads_fit(heads, k, s):
        fit = [d for d in _divisors(ranks // k) if ulysses_heads_fit(heads, k, d)]
        raise ConfigError(
            f"--sequence-parallel=ulysses gives every one of the {s} sequence ranks whole "
            f"heads, but each tensor rank holds {split_counts(heads, k)} of the model's "
            f"{heads} heads, which {s} does not divide: use --sequence-parallel-size in "
            f"{_list(fit)}, heads divisible by {k * s} (--model.heads), or "
            "--sequence-parallel=ring (any head count)")
    return LayoutPlan(k, s, ranks // (k * s), mode if s > 1 else "none",
                      config.megatron_sequence_parallel, config.zero, **_pipeline_fields(config))


def _pipeline_fields(config: Config) -> dict:
    if config.pipeline_parallel == 1:
        return {}
    return {"pipeline": config.pipeline_parallel, "schedule": config.pipeline_schedule,
            "virtual": config.virtual_stages, "microbatches": config.microbatches}


def _check_pipeline(config: Config, ranks: int, model: Any) -> int:
    """The ranks of one pipeline stage, or a ConfigError saying what works: the gpt
    model and task, a stage count that divides the ranks, a schedule that runs the
    microbatches (:func:`~mpidl.parallel.pipeline_schedule.check_layout`), a block per
    model chunk, ZeRO 1 or 2."""
    p, v, m = config.pipeline_parallel, config.virtual_stages, config.microbatches
    if not isinstance(model, GPT) or config.task != "gpt":
        raise ConfigError(f"--pipeline-parallel={p} splits the gpt model's layers into "
                          f"stages; this run's task is {config.task!r} with the model "
                          f"{config.model.name!r}: use `mpidl train gpt`, or data "
                          "parallelism (--zero for memory)")
    if ranks % p:
        raise ConfigError(f"--pipeline-parallel={p} does not divide the {ranks} ranks of "
                          f"this job (stages x tensor x sequence x data = ranks): use one of "
                          f"{_list([d for d in _divisors(ranks) if d > 1])}, or another "
                          "rank count")
    problem = schedule_flags_problem(config.pipeline_schedule, v)
    if problem:
        raise ConfigError(f"{problem} (--pipeline-parallel={p})")
    try:
        check_schedule(config.pipeline_schedule, p, m, v)
    except ValueError as e:
        raise ConfigError(f"{e} (--pipeline-parallel={p} --microbatches={m} "
                          f"--pipeline-schedule={config.pipeline_schedule} --virtual-stages="
                          f"{v})") from None
    layers = len(model.blocks)
    if p * v > layers:
        raise ConfigError(f"--pipeline-parallel={p} x --virtual-stages={v} = {p * v} model "
                          f"chunks, but the gpt model has {layers} layers: every chunk needs "
                          f"a layer; use at most {layers} chunks, or more --model.layers")
    if config.zero == 3:
        raise ConfigError("--zero=3 with --pipeline-parallel: ZeRO-3 gathers a layer's "
                          "parameters only inside its forward, and the pipeline reads them "
                          "outside it (the tied embedding, the checkpoint); use --zero=1 or "
                          "--zero=2 per stage (DeepSpeed refuses ZeRO 2-3 with pipelines too)")
    return ranks // p


class Layout:
    """The communicators of one run: ``data`` (samples are split over it), ``replicas``
    (gradients are averaged over it), and the ``grid`` when the model is split.

    ``Layout(plan, comm)`` is collective over ``comm`` (the grid's communicators are
    split from it).
    """

    def __init__(self, plan: LayoutPlan, comm: Any) -> None:
        self.plan = plan
        self.grid = None
        self.data = self.replicas = comm
        self.pipeline: PipelineModel | None = None
        if plan.split:
            self.grid = ProcessGrid(comm, tensor=plan.tensor, sequence=plan.sequence,
                                    pipeline=plan.pipeline)
            self.data, self.replicas = self.grid.data, self.grid.replicas

    def split_model(self, model: Any, wrapper: Any = None, xp: Any = None) -> Any:
        """The model this rank trains: ``model`` itself, its shards on the grid, or its
        stage's parts (a :class:`~mpidl.parallel.PipelineModel`, moved to ``xp`` and
        wrapped by ``wrapper(module, replicas)``: collective over the world)."""
        if self.grid is None:
            return model
        attention = self.plan.attention if self.plan.sequence > 1 else "ring"
        if self.plan.pipeline > 1:
            self.pipeline = pipeline_model(
                model, self.grid, microbatches=self.plan.microbatches,
                schedule=self.plan.schedule, virtual_stages=self.plan.virtual,
                sequence_parallel=self.plan.megatron, attention=attention, wrapper=wrapper,
                xp=xp)
            return self.pipeline
        return ParallelGPT(model, self.grid, sequence_parallel=self.plan.megatron,
                           attention=attention)

    def clip_grad_norm_(self, wrapper: Any, max_norm: float) -> Any:
        """Clip the averaged gradients to a global 2-norm of ``max_norm`` (every shard
        counted once); returns the norm before. Collective over the tensor group (and
        the replicas under ZeRO; the world with a pipeline)."""
        if self.pipeline is not None:
            return self.pipeline.clip_grad_norm_(max_norm)
        if self.grid is None:
            return wrapper.clip_grad_norm_(max_norm)
        if self.plan.zero:
            return wrapper.clip_grad_norm_(max_norm, tensor=self.grid.tensor)
        return clip_tensor_parallel_grad_norm_(wrapper.parameters(), max_norm, self.grid.tensor)

    def tensor_norms(self, wrapper: Any) -> TensorNorms:
        """Where the model's tensors are among ``wrapper.parameters()``, for LARS and
        LAMB (:mod:`mpidl.parallel.layerwise`): ZeRO's shards, or the model's own
        parameters, tensor-parallel shards adding up over the tensor group."""
        return wrapper.tensor_norms(None if self.grid is None else self.grid.tensor)

    def stage_keeps(self, model: Any) -> set[str] | None:
        """What this rank builds of the gpt ``model`` (a skeleton of its shapes): its
        pipeline stage's parts (:func:`~mpidl.parallel.pipeline_gpt.stage_keeps`), or
        None (all of it) without a pipeline."""
        if self.plan.pipeline == 1:
            return None
        return stage_keeps(len(model.blocks), self.plan.pipeline, self.plan.virtual,
                           self.grid.pipeline_rank, tie_weights=model.tie_weights)

    def free(self) -> None:
        if self.grid is not None:
            self.grid.free()


__all__ = ["Layout", "LayoutPlan", "plan_layout"]
