"""Activation recomputation: transformer blocks keep less for backward and recompute it.

Three modes, as Megatron-LM's ``--recompute-granularity`` (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198):

- ``none``: a block keeps what its functions keep.
- ``selective``: the attention probabilities ``P`` ``(B, H, T, T)``, the only array of a
  block that grows with ``T^2``, are not kept; backward recomputes them from q and k
  (:func:`mpidl.functions.scaled_dot_product_attention` with ``keep_probs=False``). No
  randomness is involved (mpidl has no dropout on ``P``), and the recomputed ``P`` is
  the forward's bit for bit (the same operations on the same arrays).
- ``full``: a block keeps only its input; backward re-runs the block's forward with
  the graph on and backpropagates through it (:func:`checkpoint`).

What mpidl's :class:`~mpidl.nn.TransformerEncoderLayer` keeps (:func:`block_bytes`,
measured by :func:`saved_bytes`; ``e`` bytes per element, B batch, T tokens, D width, H heads,
FFN width 4D): ``none`` 23 BTD + 4 BT + BHT^2 elements without dropout, 27 BTD + 4 BT +
BHT^2 with it (each dropout keeps its mask and its output); ``selective`` the same less
BHT^2; ``full`` BTD (the input). Korthikanti et al. count bytes at fp16 with 1-byte
masks: sbh(34 + 5as/h) per layer, i.e. 17 elements of BTD and 2.5 BHT^2; mpidl keeps
more of the first (GELU keeps its input, its output and Phi; the heads are merged into
a copy; masks are as wide as the data) and less of the second (only ``P``: no
pre-softmax scores, no dropout on ``P``). Selective removes their 5as^2b term and
mpidl's e*BHT^2 alike; full keeps their 2sbh, mpidl's e*BTD.

Randomness. A block's dropout modules draw from their own host generators
(:class:`mpidl.nn.Dropout`: one seed per call; the parallel layer's ``ShardedDropout``:
one mask per call). The recomputed forward must draw the masks of the first one: the
classic bug is a redrawn mask (OLMo-core PR #828: step-150 loss 2.495 against 2.195).
:func:`checkpoint` records every generator's state before the block's forward, and in
backward sets it back, re-runs the block, checks that the generators arrived where the
first forward left them, and returns each to the state it had when backward began (a
pipeline schedule runs other microbatches' forwards in between): every generator ends
where a run without recomputation leaves it.

Collectives. A recomputed parallel block (tensor-parallel allreduces, sequence-parallel
allgathers, Ulysses all-to-alls, ring attention's sendrecvs) runs its forward
collectives again inside its backward. Backward visits Functions in the same order on
every rank of a group (the graph has the same shape on each), so the recomputed
collectives come in the same order on every rank, each block's just before its backward
collectives.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import numpy

from mpidl.autograd import (Function, Tensor, enable_grad, fresh_grads, is_grad_enabled,
                            no_grad)
from mpidl.names import RECOMPUTE
from mpidl.nn.module import Module


def check_recompute(mode: str) -> str:
    """``mode`` if it is one of :data:`RECOMPUTE`, else a ValueError saying what is."""
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute={mode!r}: use one of {', '.join(RECOMPUTE)}")
    return mode


@runtime_checkable
class Recomputable(Protocol):
    """A block that recomputes by its ``recompute`` mode (one of :data:`RECOMPUTE`):
    :class:`~mpidl.nn.TransformerEncoderLayer`,
    :class:`~mpidl.parallel.transformer.ParallelTransformerLayer`."""

    recompute: str


def set_recompute(model: Module, mode: str) -> int:
    """Set every :class:`Recomputable` block of ``model`` to ``mode``; return how many.

    Works on a built model (single-rank, parallel, wrapped or not: the blocks are found
    among its modules); takes effect at the next forward.

    Raises:
        ValueError: an unknown mode, or ``selective``/``full`` for a model without
            transformer blocks (nothing would be recomputed).
    """
    check_recompute(mode)
    blocks = [m for _, m in model.named_modules() if isinstance(m, Recomputable)]
    if mode != "none" and not blocks:
        raise ValueError(f"recompute={mode!r}: {type(model).__name__} has no transformer "
                         "blocks to recompute; use recompute='none' for this model")
    for block in blocks:
        block.recompute = mode
    return len(blocks)


def block_bytes(mode: str, batch: int, seq: int, dim: int, heads: int, ffn: int | None = None,
                dropout: bool = False, itemsize: int = 4) -> int:
    """Bytes one :class:`~mpidl.nn.TransformerEncoderLayer` keeps for backward.

    Counted from its functions (and held to :func:`saved_bytes` by the tests): the
    input, both LayerNorm outputs, q/k/v, the attention output and its merged copy,
    the projection, the residual sum, the MLP's input, GELU's input, ``Phi`` and output,
    its projection (11 D + 3 F per token), with dropout each dropout's mask and output
    (4 D more); the LayerNorms' mean and 1/std (4 per token); ``P``, ``H T`` per token.
    ``full`` keeps the input only. Not the embedding, the last LayerNorm or the loss.
    """
    check_recompute(mode)
    ffn = 4 * dim if ffn is None else ffn
    tokens = batch * seq
    if mode == "full":
        return tokens * dim * itemsize
    per_token = (15 if dropout else 11) * dim + 3 * ffn + 4
    if mode == "none":
        per_token += heads * seq
    return tokens * per_token * itemsize


# -- full recomputation ---------------------------------------------------------------------
def _generators(module: Module) -> list:
    """The host generators ``module``'s modules draw from (their ``rng``, as Dropout's)."""
    found: list = []
    for name, m in module.named_modules():
        rng = m.__dict__.get("rng")
        if rng is None or any(rng is g for g in found):
            continue
        if not isinstance(rng, (numpy.random.Generator, numpy.random.RandomState)):
            raise ValueError(
                f"full recomputation of {type(module).__name__}: {name or 'the block'} draws "
                f"from a {type(rng).__name__}, whose state cannot be set back to draw the "
                "same values again; give it a numpy.random.Generator (mpidl.nn.Dropout's)")
        found.append(rng)
    return found


def _state(g: Any) -> Any:
    return g.bit_generator.state if isinstance(g, numpy.random.Generator) else g.get_state()


def _set_state(g: Any, state: Any) -> None:
    if isinstance(g, numpy.random.Generator):
        g.bit_generator.state = state
    else:
        g.set_state(state)


def _equal(a: Any, b: Any) -> bool:
    """Whether two generator states are equal (dicts, tuples and arrays of integers)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, numpy.ndarray):
        return numpy.array_equal(a, b)
    return a == b


class Recompute(Function):
    """``fn(x)``, keeping only ``x``: backward re-runs ``fn`` and backpropagates through it.

    Inputs: ``x`` and the parameters ``fn`` uses (their gradients are this Function's).
    """

    def forward(self, x, *params):
        self.x = x
        self.before = [_state(g) for g in self.generators]
        with no_grad():
            y = self.fn(Tensor(x))
        self.after = [_state(g) for g in self.generators]
        return y.data

    def backward(self, gy):
        needs = self.needs_input_grad
        x = Tensor(self.x, requires_grad=needs[0])
        params = [p for p, need in zip(self.inputs[1:], needs[1:]) if need]
        now = [_state(g) for g in self.generators]
        try:
            for g, state in zip(self.generators, self.before):
                _set_state(g, state)
            with fresh_grads(params) as grads, enable_grad():
                y = self.fn(x)
                drawn = [_state(g) for g in self.generators]
                if not _equal(drawn, self.after):
                    raise RuntimeError(
                        f"full recomputation of {self.name}: the recomputed forward drew "
                        "other random numbers than the first one (did train()/eval() or "
                        "the block change between forward and backward?)")
                y.backward(gy)
                by_param = dict(zip(map(id, params), grads()))
        finally:
            for g, state in zip(self.generators, now):
                _set_state(g, state)
        # Every gradient is an array of the inner pass that nothing else holds.
        self.owned_grads = tuple(range(len(needs)))
        return (x.grad, *(by_param.get(id(p)) for p in self.inputs[1:]))


def checkpoint(fn: Callable[[Tensor], Tensor], x: Tensor, block: Module) -> Tensor:
    """``fn(x)`` that keeps only ``x`` for backward (full recomputation of ``block``).

    Args:
        fn: the block's forward of one tensor; it may read ``block``'s parameters and
            draw from its modules' generators (their ``rng``), nothing else that needs
            a gradient.
        x: the block's input.
        block: the module whose parameters ``fn`` uses and whose generators are set
            back for the recomputation.

    Under :func:`~mpidl.autograd.no_grad` this is ``fn(x)``. A parallel block's
    collectives run again in backward, in the same order on every rank.
    """
    if not is_grad_enabled():
        return fn(x)
    return Recompute.apply(x, *block.parameters(), fn=fn, generators=_generators(block),
                           name=type(block).__name__)


# -- measuring what the graph keeps ---------------------------------------------------------
def _owner(a: Any) -> Any:
    while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
        a = a.base
    return a


def saved_bytes(output: Tensor) -> int:
    """Bytes of the arrays the graph behind ``output`` holds for backward.

    Counted: every array a Function saved and every input of a Function that is not a
    leaf requiring a gradient (a parameter); each memory buffer once (views count as
    their base), parameters' buffers never. Not collective.
    """
    params: set[int] = set()
    held: dict[int, int] = {}

    def arrays(value: Any):
        if (hasattr(value, "nbytes") and hasattr(value, "dtype")
                and not isinstance(value, numpy.generic)):  # a scalar holds no buffer
            yield value
        elif isinstance(value, (tuple, list)):
            for v in value:
                yield from arrays(v)

    functions, seen, stack = [], set(), [output.creator]
    while stack:
        f = stack.pop()
        if f is None or id(f) in seen or f.inputs is None:
            continue
        seen.add(id(f))
        functions.append(f)
        for x in f.inputs:
            if isinstance(x, Tensor):
                if x.creator is None and x.requires_grad:
                    params.add(id(_owner(x.data)))
                stack.append(x.creator)
    for f in functions:
        for x in f.inputs:
            if isinstance(x, Tensor):
                x = x.data
            for a in arrays(x):
                held.setdefault(id(_owner(a)), _owner(a).nbytes)
        for key, value in f.__dict__.items():
            if key != "inputs":
                for a in arrays(value):
                    held.setdefault(id(_owner(a)), _owner(a).nbytes)
    return sum(n for key, n in held.items() if key not in params)


__all__ = ["RECOMPUTE", "check_recompute", "Recomputable", "set_recompute", "checkpoint",
           "Recompute", "saved_bytes", "block_bytes"]
