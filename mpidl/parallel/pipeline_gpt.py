"""The GPT cut into pipeline parts: embedding first, blocks in between, head and loss last.

    grid = ProcessGrid(world, pipeline=4)                    # and tensor=, sequence=
    model = pipeline_gpt(grid, microbatches=8, schedule="1f1b", vocab=31, dim=16,
                         layers=8, seed=0)                    # a PipelineModel
    loss_sum, count = model.step(ids)                         # ids: this data rank's batch

Every rank builds the full :class:`~mpidl.models.GPT` from the seed (as
:func:`~mpidl.parallel.parallel_gpt` does), splits it over the tensor and sequence axes
when the grid has them (:class:`~mpidl.parallel.ParallelGPT`), and keeps the parts the
pipeline gives it (part ``k`` on stage ``k % p``); the rest is dropped. Part 0 holds the
token and position embeddings, the last part the final LayerNorm, the output projection
and the loss, and part ``k`` the blocks ``[sum(part_layers[:k]), sum(part_layers[:k+1]))``:
``part_layers`` is an explicit list, or :func:`split_layers`'s as-even-as-possible split.

Tied embeddings (``tie_weights=True``) stay one parameter, ``tok.weight`` of part 0.
When the last part sits on another stage, it receives that weight from stage 0 at the
start of every step (one message of ``V x D / t`` elements, the volume Megatron-LM's
tied-gradient allreduce moves) and sends its accumulated gradient back before part 0's
last backward, which adds it to ``tok.weight``'s own gradient inside that backward: so
the data-parallel wrapper, plain or ZeRO, reduces one gradient for one parameter, and
the checkpoint saves it once.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy

from mpidl import functions as F
from mpidl import models
from mpidl.autograd import Tensor
from mpidl.comm.base import split_counts
from mpidl.models.gpt import GPT
from mpidl.nn.container import ModuleList
from mpidl.nn.linear import linear
from mpidl.nn.module import Module, as_input
from mpidl.parallel.gpt import ParallelGPT
from mpidl.parallel.grid import ProcessGrid
from mpidl.parallel.pipeline import PipelineModel


def split_layers(layers: int, parts: int, counts: Sequence[int] | None = None) -> list[int]:
    """Blocks per part: ``counts`` checked, or ``layers`` split as evenly as possible
    (:func:`~mpidl.comm.split_counts`: the first parts take one more).

    Raises:
        ValueError: ``counts`` has not ``parts`` entries, a negative one, or does not
            sum to ``layers`` (the message names the list and the fix).
    """
    if counts is None:
        return split_counts(layers, parts)
    counts = [int(c) for c in counts]
    if len(counts) != parts or any(c < 0 for c in counts) or sum(counts) != layers:
        raise ValueError(f"pipeline layers {counts} (sum {sum(counts)}, {len(counts)} parts) "
                         f"do not split {layers} blocks into {parts} parts (pipeline x "
                         f"virtual stages); give {parts} counts >= 0 that sum to {layers}, "
                         f"e.g. {split_counts(layers, parts)}")
    return counts


class GPTPart(Module):
    """Part ``index`` of ``parts`` of a GPT or a ParallelGPT: what one pipeline chunk runs.

    It takes over the model's modules it needs (the model itself is not kept), under the
    model's own attribute names, so its ParallelGPT pieces run ParallelGPT's own
    methods (:meth:`ParallelGPT.embed`, ``logits``, ``loss_of_logits``) on it.

    Attributes:
        first, last: whether it holds the embeddings / the head and the loss.
        start: the model's index of its first block.
        tied_out: part 0 with ``receives_tied`` on another stage: the Parameter to send.
        tied_in: ``(shape, dtype)`` of the tied weight it receives (last part on another
            stage than part 0), else None; :attr:`tied_weight` is set by the engine.
    """

    def __init__(self, model: GPT | ParallelGPT, index: int, parts: int, start: int,
                 stop: int, stages: int, blocks: Mapping[int, Module] | None = None) -> None:
        super().__init__()
        self.index, self.first, self.last = index, index == 0, index == parts - 1
        self.parallel = isinstance(model, ParallelGPT)
        self.start = start
        self.vocab, self.seq_len, self.tie_weights = model.vocab, model.seq_len, model.tie_weights
        self.pad_id = model.pad_id
        self.dim, self.dtype = model.pos.data.shape[1], model.pos.data.dtype
        if self.parallel:
            self.grid, self.attention = model.grid, model.attention
            self.sequence_parallel = model.sequence_parallel
            self.vocab_start = model.tok.vocab_start
        # The tied weight crosses stages when part 0 and the last part do (p > 1).
        across = model.tie_weights and stages > 1 and parts > 1
        self.tied_out = None
        self.tied_in = None
        self.tied_weight: Tensor | None = None
        self.hits: Any = 0
        if self.first or (self.last and model.tie_weights and not across):
            self.tok = model.tok  # the same object when both parts are on this rank
        if self.first:
            self.pos = model.pos
            if across:
                self.tied_out = model.tok.weight
        blocks = model.blocks if blocks is None else blocks
        self.blocks = ModuleList(blocks[i] for i in range(start, stop))
        if self.last:
            self.norm = model.norm
            if not model.tie_weights:
                self.head = model.head
            elif across:
                w = model.tok.weight
                self.tied_in = (tuple(w.data.shape), w.data.dtype)

    def half_(self, dtype: Any) -> "GPTPart":
        """:meth:`Module.half_`, and the activations it receives and the tied weight it is
        sent become ``dtype`` too (their receive buffers are made from these)."""
        super().half_(dtype)
        self.dtype = numpy.dtype(dtype)
        if self.tied_in is not None:
            self.tied_in = (self.tied_in[0], self.dtype)
        return self

    # -- the pipeline part's contract (mpidl.parallel.pipeline.Part) ----------------------
    def forward(self, x: Any, ids: Any) -> Tensor:
        """``x`` (the previous part's output; None for part 0) and the microbatch's ids
        ``(b, T + 1)`` -> this part's output ``(b, T_here, D)``, or for the last part
        this rank's share of the summed loss (and :attr:`hits`: its share of the
        targets that are their logits' argmax)."""
        ids = as_input(ids)
        length = ids.shape[1] - 1
        tokens = self.tokens(length) if self.parallel else None
        if self.first:
            x = self.embed(ids[:, :-1])
        for block in self.blocks:
            x = block(x, tokens) if self.parallel else block(x)
        if not self.last:
            return x
        weight = self.tied_weight if self.tied_in is not None else None
        if self.parallel:  # this rank's share of the loss and of the hits
            loss, self.hits = self.loss_of_logits(self.logits(x, length, weight), ids,
                                                  hits=True)
            return loss
        if weight is None:
            weight = self.tok.weight if self.tie_weights else self.head.weight
        logits = linear(self.norm(x), weight)  # (b, T, vocab), as GPT.forward
        targets = ids[:, 1:]
        hit = logits.data.argmax(-1) == targets
        if self.pad_id is not None:
            hit &= targets != self.pad_id
        self.hits = hit.sum()  # as LanguageModel.step counts them
        return F.softmax_cross_entropy(logits, targets, ignore_index=self.pad_id,
                                       reduction="sum")

    def input_shape(self, ids: Any) -> tuple[int, ...]:
        """The shape of the activation this part receives for microbatch ``ids``."""
        b, length = ids.shape[0], ids.shape[1] - 1
        if self.parallel:
            return (b, len(self.tokens(length).positions), self.dim)
        return (b, length, self.dim)

    def count_targets(self, ids: Any) -> int:
        """How many next-token targets of ``ids`` count (not collective)."""
        return GPT.count_targets(self, ids)

    # -- the model's pieces ----------------------------------------------------------------
    def embed(self, ids: Any) -> Tensor:
        if self.parallel:
            return ParallelGPT.embed(self, ids)
        t = ids.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.seq_len}")
        pos = self.pos if t == self.seq_len else F.getitem(self.pos, slice(0, t))
        return F.add(self.tok(ids), pos)  # (B, T, D), as GPT.forward

    # ParallelGPT's methods read these attributes only; the part has them.
    layout = ParallelGPT.layout
    tokens = ParallelGPT.tokens
    logits = ParallelGPT.logits
    loss_of_logits = ParallelGPT.loss_of_logits

    def full_names(self) -> dict[str, str]:
        """This part's parameter names -> the single-rank model's names."""
        return {name: self.full_name(name) for name, _ in self.named_parameters()}

    def full_name(self, name: str) -> str:
        """The single-rank model's name of this part's parameter, buffer or module
        ``name`` (its blocks are the model's from :attr:`start` on)."""
        head, _, rest = name.partition(".")
        if head != "blocks" or not rest:
            return name
        j, _, tail = rest.partition(".")
        return ".".join(p for p in ("blocks", str(self.start + int(j)), tail) if p)

    def extra_repr(self) -> str:
        return (f"part={self.index}, blocks={self.start}..{self.start + len(self.blocks) - 1}"
                f"{', embedding' if self.first else ''}{', head+loss' if self.last else ''}")


def _part_starts(layers: int, parts: int, counts: Sequence[int] | None) -> list[int]:
    counts = split_layers(layers, parts, counts)
    return [sum(counts[:k]) for k in range(parts + 1)]


def stage_blocks(layers: int, stages: int, virtual: int = 1, stage: int = 0,
                 part_layers: Sequence[int] | None = None) -> list[int]:
    """The indices of the blocks stage ``stage`` holds (its parts', in order)."""
    parts = stages * virtual
    starts = _part_starts(layers, parts, part_layers)
    return [i for k in range(stage, parts, stages) for i in range(starts[k], starts[k + 1])]


def stage_keeps(layers: int, stages: int, virtual: int = 1, stage: int = 0,
                part_layers: Sequence[int] | None = None,
                tie_weights: bool = True) -> set[str]:
    """What :class:`~mpidl.models.GPT` builds for stage ``stage`` (its ``keep``): the
    stage's blocks, the embeddings on the first part's stage, the final norm (and an
    untied head) on the last's. A tied embedding is not kept on the last stage: it is
    sent there every step (only its shape and dtype are read)."""
    parts = stages * virtual
    keep = {f"blocks.{i}" for i in stage_blocks(layers, stages, virtual, stage, part_layers)}
    if stage == 0:
        keep |= {"tok", "pos"}
    if stage == (parts - 1) % stages:
        keep |= {"norm"} if tie_weights else {"norm", "head"}
    return keep


def gpt_parts(model: GPT | ParallelGPT, stages: int, virtual: int = 1, stage: int = 0,
              layers: Sequence[int] | None = None,
              blocks: Mapping[int, Module] | None = None) -> list[GPTPart]:
    """The parts stage ``stage`` of ``stages`` holds, ``virtual`` per stage (part ``k``
    on stage ``k % stages``), cut from ``model`` (not collective). ``blocks``: the
    model's blocks by index where not ``model.blocks`` (those of this stage at least)."""
    parts = stages * virtual
    total = len(model.blocks) if blocks is None else getattr(model, "layers", len(blocks))
    starts = _part_starts(total, parts, layers)
    return [GPTPart(model, k, parts, starts[k], starts[k + 1], stages, blocks)
            for k in range(stage, parts, stages)]


def pipeline_gpt(grid: ProcessGrid, *, microbatches: int, schedule: str = "1f1b",
                 virtual_stages: int = 1, part_layers: Sequence[int] | None = None,
                 sequence_parallel: bool = False, attention: str = "ring",
                 wrapper: Any = None, **gpt_kwargs: Any) -> PipelineModel:
    """:func:`mpidl.models.gpt` (same arguments, same seed, same parameters) in pipeline
    stages over ``grid``, each stage split over the grid's tensor and sequence axes.

    Collective over the world (the grid's groups compare and wrap the parts).
    ``part_layers``: blocks per part (``pipeline * virtual_stages`` counts; default as
    even as possible; ``layers`` is the GPT's own argument, the total). ``wrapper``: as
    :class:`~mpidl.parallel.pipeline.PipelineModel`.
    """
    # Only this stage's layers are built (their values those of the whole build).
    layers = gpt_kwargs.get("layers", 2)
    keep = stage_keeps(layers, grid.pipeline_size, virtual_stages, grid.pipeline_rank,
                       part_layers, gpt_kwargs.get("tie_weights", True))
    return pipeline_model(models.gpt(**gpt_kwargs, keep=keep), grid, microbatches=microbatches,
                          schedule=schedule, virtual_stages=virtual_stages,
                          part_layers=part_layers, sequence_parallel=sequence_parallel,
                          attention=attention, wrapper=wrapper)


def pipeline_model(model: GPT, grid: ProcessGrid, *, microbatches: int,
                   schedule: str = "1f1b", virtual_stages: int = 1,
                   part_layers: Sequence[int] | None = None, sequence_parallel: bool = False,
                   attention: str = "ring", wrapper: Any = None,
                   xp: Any = None) -> PipelineModel:
    """A built single-rank ``model`` (the same on every rank: same seed) in pipeline
    stages over ``grid``, as :func:`pipeline_gpt`; the parts take over its modules, so
    what was set on them before (dropout generators, recomputation) stays. ``xp``: the
    array module the parts move to once cut (None: where they are), so a model built
    per stage (``GPT(keep=...)``) never moves the others' placeholders. Collective
    over the world."""
    names = [n for n, _ in model.named_parameters()]
    blocks = None
    if grid.tensor_size > 1 or grid.sequence_size > 1:
        # Only this stage's blocks are split (a stage-built model holds no others:
        # GPT(keep=...)); the parts find them by their index in the whole model.
        here = stage_blocks(len(model.blocks), grid.pipeline_size, virtual_stages,
                            grid.pipeline_rank, part_layers)
        every = model.blocks
        model.blocks = ModuleList(every[i] for i in here)
        try:
            parallel = ParallelGPT(model, grid, sequence_parallel=sequence_parallel,
                                   attention=attention)
        finally:
            model.blocks = every  # the caller's model as it was
        parallel.layers = len(every)
        blocks = dict(zip(here, parallel.blocks))
        model = parallel
    parts = gpt_parts(model, grid.pipeline_size, virtual_stages, grid.pipeline_rank,
                      part_layers, blocks)
    if xp is not None:
        for part in parts:
            part.to(xp)
    return PipelineModel(grid, parts, schedule=schedule, microbatches=microbatches,
                         wrapper=wrapper, names=names)


__all__ = ["GPTPart", "gpt_parts", "pipeline_gpt", "pipeline_model", "split_layers",
           "stage_blocks", "stage_keeps"]
