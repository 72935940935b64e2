"""What each way of distributing a training costs a rank: model state and communication.

The formulas `mpidl plan` prices for each mode at ``n`` ranks (float32: 4 bytes a value;
``Ψ`` parameters; ``c`` optimizer copies per parameter, AdamW 2, SGD with momentum 1,
plain SGD 0; for the split modes of the gpt model ``B`` samples per data rank, ``T``
tokens, ``D`` the width, ``L`` layers)::

    mode          model state per rank          communication per step
    data          (8 + 4c) Ψ                    allreduce of 4Ψ over n
    ZeRO 1        8Ψ + 4cΨ/n                    reduce-scatter + allgather of 4Ψ (an
                                                allreduce's volume)
    ZeRO 2        4Ψ + (4 + 4c) Ψ/n             the same
    ZeRO 3        (8 + 4c) Ψ/n                  + one more allgather (1.5x data's)
    tensor t      (8 + 4c) Ψ/t                  per layer 4 allreduces of 4BTD over t;
                                                allreduce of 4Ψ/t over the n/t replicas
    Ulysses s     (8 + 4c) Ψ                    per layer 4 all-to-alls of 8BTD/s over s;
                                                allreduce of 4Ψ over the n replicas
    ring s        (8 + 4c) Ψ                    per layer 3s - 2 sendrecvs of 8BTD/s;
                                                allreduce of 4Ψ over the n replicas

(the per-layer counts are those of docs/model-parallel.md, counted by the tests of
``mpidl.parallel``). "The largest model that fits" is the ``Ψ`` whose state fills a
rank's memory: activations are left out (they depend on the batch, and the split modes
exist to divide them), so it is an upper bound. Compute is the data-parallel share of
the step (``ceil(G / n)`` samples' worth) in every mode: the split modes' replicated
work (LayerNorms, residuals; measured in docs/model-parallel.md) is not counted, nor
the overlap of the ring's exchanges with its block compute.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mpidl.parallel.sequence import ulysses_heads_fit

VALUE = 4  # bytes per float32 value


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the mode formulas read of a training."""

    params: int                   # Ψ
    copies: int                   # optimizer state copies per parameter
    global_batch: int
    layers: int = 0               # the gpt model's sizes (0: not a model that splits)
    dim: int = 0
    tokens: int = 0
    heads: int = 0


@dataclasses.dataclass
class ModeCost:
    """One mode at ``ranks`` ranks."""

    mode: str
    ranks: int
    layout: str
    state_bytes: float            # per rank: parameters + gradients + optimizer state
    comm_s: float                 # per step, not overlapped
    largest_params: float         # the Ψ whose state fills ``memory`` bytes per rank

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def state_bytes_per_param(mode: str, n: int, copies: int) -> float:
    """Bytes of model state each rank holds per parameter in ``mode`` over ``n``."""
    full = 2 * VALUE + copies * VALUE  # parameters, gradients, optimizer state
    if mode == "zero1":
        return 2 * VALUE + copies * VALUE / n
    if mode == "zero2":
        return VALUE + (VALUE + copies * VALUE) / n
    if mode in ("zero3", "tensor"):
        return full / n
    return full  # data, ulysses, ring: every rank holds the parameters


def _gradient_exchange(mode: str, grad_bytes: float, n: int, time: Callable) -> float:
    if mode == "data":
        return time("allreduce", grad_bytes, n)
    once = time("reduce_scatter", grad_bytes, n) + time("allgather", grad_bytes, n)
    return once + (time("allgather", grad_bytes, n) if mode == "zero3" else 0.0)


def modes_for(shape: Shape, ranks: int, memory: float, time: Callable[[str, float, int], float]
              ) -> list[ModeCost]:
    """Every mode that works at ``ranks`` for ``shape``, priced by ``time(op, bytes, ranks)``
    (an :class:`hpc.costmodel.NetworkProfile`'s, or a link's), for ``memory`` bytes per rank.

    The split modes use the whole job (tensor ``t = ranks`` when the heads allow it;
    Ulysses ``s = ranks`` when it divides the heads; the ring at any size): their
    per-layer messages then cross the same link as the gradient's.
    """
    grad = VALUE * shape.params
    out = []

    def add(mode: str, layout: str, group: int, comm: float) -> None:
        per = state_bytes_per_param(mode, group, shape.copies)
        out.append(ModeCost(mode, ranks, layout, per * shape.params, comm,
                            memory / per if memory > 0 else 0.0))

    for mode in ("data", "zero1", "zero2", "zero3"):
        add(mode, f"{mode} x {ranks}", ranks, _gradient_exchange(mode, grad, ranks, time))
    if ranks < 2 or not shape.layers:
        return out
    btd = shape.global_batch * shape.tokens * shape.dim * VALUE  # one data rank: all of G
    per_layer = shape.layers
    if ranks <= shape.heads:
        add("tensor", f"tensor {ranks}", ranks, per_layer * 4 * time("allreduce", btd, ranks))
    if ulysses_heads_fit(shape.heads, sequence=ranks) and ranks <= shape.tokens:
        add("ulysses", f"Ulysses {ranks}", ranks,
            per_layer * 4 * time("alltoall", 2 * btd / ranks, ranks)
            + time("allreduce", grad, ranks))
    if ranks <= shape.tokens:
        add("ring", f"ring {ranks}", ranks,
            per_layer * (3 * ranks - 2) * time("sendrecv", 2 * btd / ranks, ranks)
            + time("allreduce", grad, ranks))
    return out


def shape_of(config: Any, model: Any, params: int, copies: int, tokens: int) -> Shape:
    """The formulas' view of a configured model (the gpt model's sizes when it is one)."""
    from mpidl.models.gpt import GPT

    if not isinstance(model, GPT) or not len(model.blocks):
        return Shape(params, copies, config.global_batch)
    attn = model.blocks[0].self_attn
    return Shape(params, copies, config.global_batch, layers=len(model.blocks), dim=attn.dim,
                 tokens=tokens, heads=attn.heads)


def format_modes(rows: list[ModeCost]) -> str:
    """The modes table: state per rank, the largest model that fits, communication."""
    head = (f"{'ranks':>5} {'mode':<12} {'state MB/rank':>13} {'largest model':>14} "
            f"{'comm ms/step':>12}")
    lines = [head]
    for r in rows:
        fits = f"{r.largest_params / 1e6:,.0f} M" if r.largest_params else "-"
        lines.append(f"{r.ranks:5d} {r.layout:<12} {r.state_bytes / 1e6:13.2f} {fits:>14} "
                     f"{r.comm_s * 1e3:12.3f}")
    return "\n".join(lines)


__all__ = ["Shape", "ModeCost", "modes_for", "shape_of", "format_modes",
           "state_bytes_per_param"]
