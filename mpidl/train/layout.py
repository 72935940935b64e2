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
from mpidl.parallel import ParallelGPT, ProcessGrid
from mpidl.optim.layerwise import TensorNorms
from mpidl.parallel.layerwise import whole_tensor_norms
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

    @property
    def split(self) -> bool:
        """Whether the model is split at all (else: data parallelism, the trainer's own)."""
        return self.tensor * self.sequence > 1

    def describe(self) -> str:
        parts = [f"data {self.data} x tensor {self.tensor} x sequence {self.sequence}"]
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
        return LayoutPlan(data=ranks, attention=mode)
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
                      config.megatron_sequence_parallel, config.zero)


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
        if plan.split:
            self.grid = ProcessGrid(comm, tensor=plan.tensor, sequence=plan.sequence)
            self.data, self.replicas = self.grid.data, self.grid.replicas

    def split_model(self, model: Any) -> Any:
        """The model this rank trains: ``model`` itself, or its shards on the grid."""
        if self.grid is None:
            return model
        return ParallelGPT(model, self.grid, sequence_parallel=self.plan.megatron,
                           attention=self.plan.attention if self.plan.sequence > 1 else "ring")

    def clip_grad_norm_(self, wrapper: Any, max_norm: float) -> Any:
        """Clip the averaged gradients to a global 2-norm of ``max_norm`` (every shard
        counted once); returns the norm before. Collective over the tensor group (and
        the replicas under ZeRO)."""
        if self.grid is None:
            return wrapper.clip_grad_norm_(max_norm)
        if self.plan.zero:
            return wrapper.clip_grad_norm_(max_norm, tensor=self.grid.tensor)
        return clip_tensor_parallel_grad_norm_(wrapper.parameters(), max_norm, self.grid.tensor)

    def tensor_norms(self, wrapper: Any) -> TensorNorms:
        """Where the model's tensors are among ``wrapper.parameters()``, for LARS and
        LAMB (:mod:`mpidl.parallel.layerwise`): ZeRO's shards, or the model's own
        parameters, tensor-parallel shards adding up over the tensor group."""
        tensor = None if self.grid is None else self.grid.tensor
        if self.plan.zero:
            return wrapper.tensor_norms(tensor)
        return whole_tensor_norms(wrapper.parameters(), tensor)

    def free(self) -> None:
        if self.grid is not None:
            self.grid.free()


__all__ = ["Layout", "LayoutPlan", "plan_layout"]
