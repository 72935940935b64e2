"""Tensor x pipeline x data layouts of the gpt model: memory per rank and step time.

What ``mpidl plan --layouts`` prices for a GPT shape (``L`` layers, width ``h``, ``a``
heads, sequence ``s``, vocabulary ``V``, global batch ``B`` sequences) on ``N = t p d``
ranks: tensor parallelism ``t`` inside a node with Megatron's sequence parallelism, a
pipeline of ``p`` stages outermost, data parallelism ``d`` over the rest, microbatches of
``b`` sequences, ``m = B / (d b)`` of them per step. Sources: Narayanan et al. 2021
(arXiv 2104.04473, "[P3]"), Korthikanti et al. 2022 (arXiv 2205.05198, "[P4]"),
Megatron-LM's code and docs ("[M]"), as collected in shared/research/pipeline-and-memory.md
and model-parallel.md; *derived* marks our own arithmetic.

**Memory per rank** (the heaviest stage: the first holds the embeddings and the most
microbatches in flight, the last the output layer's logits):

- model state, bytes per parameter (Megatron's distributed-optimizer table [M]; ``c``
  optimizer copies, AdamW 2; "sharded" parts divided by ``d`` under ZeRO 1)::

      precision  unsharded                 sharded                     AdamW, d = 1
      fp32       params 4 + grads 4        moments 4c                  16
      bf16       params 2 + fp32 grads 4   fp32 master 4 + moments 4c  18
      fp16       params 2 + grads 2        fp32 master 4 + fp32 grads 4 + moments 4c  20

- activations of one layer for one microbatch [P4], 2-byte activations and 1-byte
  masks (scaled by the element size: x2 in fp32)::

      tensor + sequence parallel   sbh (34 + 5as/h) / t
      tensor parallel only         sbh (10 + 24/t + 5as/(ht))
      selective recomputation      drops the 5as^2b/t of attention scores and softmax
      full recomputation           keeps the layer's input: 2sbh (/t when sequence-split)

  times the layers of a stage and the microbatches it holds: GPipe all ``m``; 1F1B's
  first stage ``min(p, m)`` [P3]; interleaved x ``(1 + (p-1)/(p v))`` (*derived* from
  Megatron's warm-up count); no pipeline: one. The last stage adds the logits and their
  softmax in fp32, ``4 s b V / t`` bytes (*derived*).

**Step time** (*derived* from [P3]): ``T = (m + (p-1)/v) t_mb + p2p + dp + tied``, where

- ``t_mb``, one microbatch through one stage: its FLOPs over the device's sustained rate
  plus its tensor-parallel exchanges (per layer 2 forward, 2 backward, 2 more recomputing
  under full recomputation, each ``b s h`` elements over ``t``: an allreduce, or an
  allgather and a reduce-scatter of the same volume with sequence parallelism [P4]);
- the bubble ``(p-1)/(v m)`` of the ideal time (GPipe and 1F1B ``v = 1``) [P3];
- ``p2p``: ``2 v m`` messages a rank of ``b s h / t`` elements (sequence-split) [P3, M],
  counted exposed (Megatron overlaps them only for interleaving);
- ``dp``: each stage's gradients, ``Psi/(p t)`` parameters of the stage (fp32 but for
  fp16), reduced over ``d`` ranks (ZeRO 1: reduce-scatter + allgather, the same volume),
  counted exposed (the first stage's is, it finishes last);
- ``tied``: the embedding gradient (``V h / t``) allreduced between the first and last
  stage when ``p > 1`` [M].

FLOPs of a step (*derived*, matching [P3]'s ``96 B s L h^2 (1 + s/6h + V/16Lh)`` with
full recomputation): per token and layer a forward of ``24 h^2 + 4 s h`` (``8h^2 + 4hf +
4sh`` with feed-forward width ``f``), backward twice that, the output layer ``6 h V``;
*model* FLOPs count these once, *hardware* FLOPs add the recomputed forward (full) or
its two ``s x s`` products, ``4 s h`` (selective). Model-FLOPs utilisation (MFU) is model
FLOPs / (step time x N x the precision's peak). Not counted: the optimizer step, the
LayerNorm/softmax/GELU memory-bound kernels beyond what the sustained rate absorbs,
overlap of the data-parallel reduction with the cool-down.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

from mpidl.names import PIPELINE_SCHEDULES as SCHEDULES
from mpidl.names import PRECISIONS, RECOMPUTE
ELEMENT = {"fp32": 4, "fp16": 2, "bf16": 2}       # bytes of a parameter / activation
GRAD = {"fp32": 4, "fp16": 2, "bf16": 4}          # bytes of a reduced gradient element


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """The sizes of a gpt model and its batch (``ffn`` 0: ``4 * hidden``)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int
    ffn: int = 0
    tied: bool = True

    @property
    def width(self) -> int:
        return self.ffn or 4 * self.hidden

    def layer_params(self) -> int:
        """One block: attention 4h^2 + 4h, MLP 2hf + f + h, two LayerNorms 4h."""
        h, f = self.hidden, self.width
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h

    def embedding_params(self) -> int:
        """Token table and learned positions (the output layer shares the table)."""
        return self.vocab * self.hidden + self.seq * self.hidden

    def params(self) -> int:
        """All parameters: the blocks, the embeddings, the final LayerNorm (and the head
        when untied)."""
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.layer_params() + self.embedding_params() + 2 * self.hidden + head

    def layer_forward_flops(self) -> float:
        """Matmul FLOPs of one layer's forward per token: QKV and output 8h^2, MLP 4hf,
        the two s x s products 4sh."""
        h = self.hidden
        return 8 * h * h + 4 * h * self.width + 4 * self.seq * h

    def model_flops(self) -> float:
        """Model FLOPs of one step (forward + backward, no recomputation)."""
        tokens = self.global_batch * self.seq
        return 3.0 * tokens * (self.layers * self.layer_forward_flops()
                               + 2 * self.hidden * self.vocab)

    def hardware_flops(self, recompute: str) -> float:
        """FLOPs the devices run: the model's plus what recomputation repeats."""
        tokens = self.global_batch * self.seq
        extra = {"none": 0.0, "selective": 4.0 * self.seq * self.hidden,
                 "full": self.layer_forward_flops()}[recompute]
        return self.model_flops() + tokens * self.layers * extra


@dataclasses.dataclass(frozen=True)
class Options:
    """How the layouts train: precision, recomputation, schedule, microbatch size."""

    precision: str = "fp32"
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual: int = 1               # model chunks per rank (interleaved)
    microbatch: int = 1            # sequences per microbatch (b)
    zero: int = 0                  # 0 or 1 (distributed optimizer)
    copies: int = 2                # optimizer state per parameter (AdamW 2)
    sequence_parallel: bool = True  # Megatron's, with t > 1


def state_bytes_per_param(precision: str, d: int, zero: int, copies: int = 2) -> float:
    """Bytes of model state per parameter of a rank (the table in the module docstring)."""
    unsharded, sharded = {"fp32": (8, 4 * copies), "bf16": (6, 4 + 4 * copies),
                          "fp16": (4, 8 + 4 * copies)}[precision]
    return unsharded + sharded / (d if zero else 1)


def activation_bytes_per_layer(shape: GPTShape, b: int, t: int, recompute: str,
                               precision: str, sequence_parallel: bool = True) -> float:
    """Bytes one layer keeps for backward of one microbatch of ``b`` sequences ([P4])."""
    s, h, a = shape.seq, shape.hidden, shape.heads
    sbh = s * b * h
    sp = sequence_parallel and t > 1
    if recompute == "full":
        kept = 2.0 * sbh / (t if sp else 1)
    else:
        kept = 34.0 * sbh / t if sp else sbh * (10.0 + 24.0 / t)
        if recompute == "none":
            kept += 5.0 * a * s * s * b / t
    return kept * ELEMENT[precision] / 2  # the formula counts 2-byte activations


def microbatches_in_flight(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Microbatches of its layers the first stage holds at its peak."""
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    held = float(min(p, m))
    return held * (1 + (p - 1) / (p * v)) if schedule == "interleaved" else held


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle time over ideal time: ``(p-1)/m``, interleaved ``(p-1)/(v m)`` ([P3])."""
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m)


@dataclasses.dataclass
class LayoutCost:
    """One ``t x p x d`` layout: its memory per rank and step time."""

    ranks: int
    tensor: int
    pipeline: int
    data: int
    microbatches: int
    bubble: float                  # of the ideal time
    state_bytes: float             # model state, heaviest stage, per rank
    activation_bytes: float        # activations, heaviest stage, per rank
    memory_bytes: float            # the two together
    fits: bool
    compute_s: float               # m microbatches of one stage, ideal
    tensor_comm_s: float           # tensor-parallel exchanges on the critical path
    bubble_s: float
    p2p_s: float
    p2p_bytes: float               # per rank per step
    dp_s: float
    tied_s: float
    step_s: float
    mfu: float | None              # model FLOPs utilisation (None: no peak known)
    tflops_per_rank: float         # hardware FLOP/s a rank sustains over the step

    @property
    def layout(self) -> str:
        return f"t{self.tensor} x p{self.pipeline} x d{self.data}"

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layout": self.layout}


def within_a_node(span: int, ranks: int, ranks_per_node: int) -> bool:
    """Whether every group of ``span`` consecutive ranks (groups starting at multiples of
    ``span``) of a job of ``ranks`` lies in one node, nodes filled in rank order: the
    whole job fits in one node, or a node holds a whole number of groups. Else some group
    straddles two nodes (at 4 a node, ranks 3-5 of groups of 3) and, the slowest group
    setting the pace, its exchange crosses the network."""
    per_node = max(ranks_per_node, 1)
    return ranks <= per_node or per_node % span == 0


def _span_link(span: int, ranks: int, ranks_per_node: int, node: Callable,
               network: Callable) -> Callable:
    return node if within_a_node(span, ranks, ranks_per_node) else network


def price(shape: GPTShape, opts: Options, t: int, p: int, d: int, rate: float,
          peak: float | None, memory: float, ranks_per_node: int,
          node_time: Callable[[str, float, int], float],
          network_time: Callable[[str, float, int], float]) -> LayoutCost:
    """The cost of one layout. ``rate``: sustained FLOP/s of a rank in ``opts.precision``;
    ``peak``: its peak (MFU); ``memory``: bytes per rank; ``*_time(op, bytes, ranks)``:
    collectives within a node and across nodes (ranks placed tensor fastest, then data,
    then pipeline, nodes filled in rank order: a group spanning more ranks than a node
    holds crosses the network)."""
    n = t * p * d
    b, v, e = opts.microbatch, opts.virtual, ELEMENT[opts.precision]
    m = shape.global_batch // (d * b)
    per_stage = math.ceil(shape.layers / p)  # uneven splits: the heaviest stage
    tensor_link = _span_link(t, n, ranks_per_node, node_time, network_time)
    data_link = _span_link(t * d, n, ranks_per_node, node_time, network_time)
    pipe_link = _span_link(n, n, ranks_per_node, node_time, network_time)
    # memory: the first stage (embeddings, most in flight) and the last (logits)
    per_param = state_bytes_per_param(opts.precision, d, opts.zero, opts.copies)
    blocks = per_stage * shape.layer_params() / t
    table = shape.vocab * shape.hidden / t  # vocabulary-parallel
    embed = table + shape.seq * shape.hidden
    # The last stage's output layer: the final LayerNorm and the table, a copy of the
    # first stage's when tied (Megatron), none on a single stage that holds it already.
    head = 2 * shape.hidden + (table if p > 1 or not shape.tied else 0.0)
    act = per_stage * activation_bytes_per_layer(shape, b, t, opts.recompute, opts.precision,
                                                 opts.sequence_parallel)
    held = microbatches_in_flight(opts.schedule, p, m, v)
    logits = 4.0 * shape.seq * b * shape.vocab / t
    if p == 1:
        stages = [(blocks + embed + head, act + logits)]
    else:  # 1F1B's last stage holds one microbatch, GPipe's all m
        stages = [(blocks + embed, act * held),
                  (blocks + head, act * (held if opts.schedule == "gpipe" else 1) + logits)]
    params, acts = max(stages, key=lambda st: st[0] * per_param + st[1])
    state = params * per_param
    # time
    hw = shape.hardware_flops(opts.recompute)
    compute_mb = hw / (shape.global_batch / b) / (p * t) / rate
    exchanges = 6 if opts.recompute == "full" else 4
    act_bytes = shape.seq * b * shape.hidden * e
    tp_mb = per_stage * exchanges * tensor_link("allreduce", act_bytes, t) if t > 1 else 0.0
    t_mb = compute_mb + tp_mb
    slots = m + (p - 1) / (v if opts.schedule == "interleaved" else 1)
    message = act_bytes / (t if opts.sequence_parallel and t > 1 else 1)
    p2p_msgs = 2 * v * m if p > 1 else 0
    p2p = p2p_msgs * pipe_link("sendrecv", message, 2) if p > 1 else 0.0
    dp = data_link("allreduce", params * GRAD[opts.precision], d) if d > 1 else 0.0
    tied = (pipe_link("allreduce", shape.vocab * shape.hidden / t * GRAD[opts.precision], 2)
            if p > 1 and shape.tied else 0.0)
    step = slots * t_mb + p2p + dp + tied
    return LayoutCost(
        ranks=n, tensor=t, pipeline=p, data=d, microbatches=m,
        bubble=bubble_fraction(opts.schedule, p, m, v), state_bytes=state,
        activation_bytes=acts, memory_bytes=state + acts,
        fits=memory <= 0 or state + acts <= memory, compute_s=m * compute_mb,
        tensor_comm_s=slots * tp_mb, bubble_s=(slots - m) * compute_mb, p2p_s=p2p,
        p2p_bytes=p2p_msgs * message, dp_s=dp, tied_s=tied, step_s=step,
        mfu=shape.model_flops() / (step * n * peak) if peak else None,
        tflops_per_rank=hw / (step * n) / 1e12)


def layout_problem(shape: GPTShape, opts: Options, t: int, p: int, d: int) -> str | None:
    """Why ``t x p x d`` cannot run ``shape`` with ``opts`` (None: it can)."""
    b, v = opts.microbatch, opts.virtual
    if shape.heads % t or shape.hidden % t:
        return f"tensor {t} does not divide the {shape.heads} heads and width {shape.hidden}"
    if p > shape.layers:
        return f"{p} stages for {shape.layers} layers: a stage needs a layer"
    if shape.global_batch % (d * b):
        return (f"the global batch {shape.global_batch} is not {d} data ranks x "
                f"microbatches of {b}")
    m = shape.global_batch // (d * b)
    if p > 1 and opts.schedule != "gpipe" and m < p:
        return f"{m} microbatches for {p} stages: 1F1B needs at least as many as stages"
    if opts.schedule == "interleaved" and p > 1:
        if shape.layers % (p * v):
            return f"{shape.layers} layers do not split into {p} stages x {v} chunks"
        if m % p:
            return f"{m} microbatches are not a multiple of the {p} stages (interleaved)"
    return None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def search(shape: GPTShape, opts: Options, ranks: int, ranks_per_node: int,
           tensors: Iterable[int] | None = None, pipelines: Iterable[int] | None = None,
           **price_args: Any) -> list[LayoutCost]:
    """Every valid layout of ``ranks`` (tensor within a node), priced; fitting ones first,
    each group by step time. ``tensors``/``pipelines`` restrict the degrees tried."""
    out = []
    for t in (tensors or _divisors(ranks)):
        if ranks % t or not within_a_node(t, ranks, ranks_per_node):
            continue
        for p in (pipelines or _divisors(ranks // t)):
            if (ranks // t) % p:
                continue
            d = ranks // (t * p)
            if layout_problem(shape, opts, t, p, d) is None:
                out.append(price(shape, opts, t, p, d, ranks_per_node=ranks_per_node,
                                 **price_args))
    return sorted(out, key=lambda c: (not c.fits, c.step_s))


def format_layouts(rows: list[LayoutCost], limit: int = 12) -> str:
    """The layouts table: the best ``limit`` rows."""
    head = (f"{'ranks':>5} {'layout':<16} {'m':>4} {'bubble':>6} {'state GB':>8} "
            f"{'act GB':>7} {'fits':>4} {'step s':>8} {'p2p ms':>7} {'dp ms':>8} "
            f"{'TFLOP/s':>7} {'MFU':>5}")
    lines = [head]
    for r in rows[:limit]:
        mfu = f"{r.mfu:5.1%}" if r.mfu is not None else "    -"
        lines.append(f"{r.ranks:5d} {r.layout:<16} {r.microbatches:4d} {r.bubble:6.1%} "
                     f"{r.state_bytes / 1e9:8.1f} {r.activation_bytes / 1e9:7.1f} "
                     f"{'yes' if r.fits else 'no':>4} {r.step_s:8.2f} {r.p2p_s * 1e3:7.1f} "
                     f"{r.dp_s * 1e3:8.1f} {r.tflops_per_rank:7.1f} {mfu}")
    return "\n".join(lines)


__all__ = ["GPTShape", "Options", "LayoutCost", "PRECISIONS", "RECOMPUTE", "SCHEDULES",
           "state_bytes_per_param", "activation_bytes_per_layer", "microbatches_in_flight",
           "bubble_fraction", "price", "layout_problem", "search", "format_layouts"]
