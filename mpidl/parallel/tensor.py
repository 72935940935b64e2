"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): weights split across a group.

A transformer block's two halves each become one column-parallel layer followed by one
row-parallel layer::

    attention:  x -> f -> in_proj (columns: this rank's heads) -> attention on those heads
                  -> out_proj (rows: the same heads) -> g -> + bias
    MLP:        x -> f -> linear1 (columns: this rank's hidden units) -> GELU
                  -> linear2 (rows: the same units) -> g -> + bias

``f`` is the identity in forward and an allreduce in backward, ``g`` the reverse
(:mod:`mpidl.parallel.mappings`): one allreduce of ``B x T x D`` per block in forward
and one in backward. The vocabulary is split the same way: :class:`VocabParallelEmbedding`
looks up the ids its rows hold (zeros elsewhere) and sums over the group, the tied
output projection is then column-parallel over the same rows, and
:func:`vocab_parallel_cross_entropy` normalises over the split vocabulary with two small
allreduces per call (the row max, then the sum of exponentials and the target's logit),
never gathering the logits.

With ``sequence_parallel=True`` (Korthikanti et al. 2022) the activations outside the
column/row pairs are split along the sequence instead of replicated: ``f`` becomes an
allgather and ``g`` a reduce-scatter. The LayerNorms and dropouts there then see
``1/t`` of the tokens, and their replicated parameters' gradients are partial sums; they
go through ``f`` on the way in, so backward sums them over the group (the pitfall
Megatron's ``_allreduce_layernorm_grads`` exists for).

Every layer is built from the full (single-rank) layer, the same on every rank, and
keeps this rank's shard: a layer built from a seed has exactly the single-rank model's
parameters. A sharded parameter carries a :class:`Shard` (``param.shard``) that says how
to cut it out of the full array and put it back together; :func:`full_state_dict` and
:func:`load_full_state_dict` use it (:mod:`mpidl.parallel.tensor_state`, imported here),
so a checkpoint holds full parameters under the single-rank model's names and loads into
any layout.

Shards follow :func:`mpidl.comm.split_counts`: the sizes need not divide (7 hidden units
over 3 ranks are 3, 2, 2), but every rank needs at least one head, unit and vocabulary
row.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.backend import as_numpy, get_array_module
from mpidl.comm.base import Communicator, split_counts
from mpidl.nn.embedding import Embedding
from mpidl.optim.clip import gradient_norm
from mpidl.nn.linear import Linear, linear
from mpidl.nn.module import Module, Parameter, as_input
from mpidl.parallel.mappings import (copy_to_region, gathered_linear, reduce_from_region,
                                     scatter_sequence)
from mpidl.parallel.tensor_state import (full_optimizer_state, full_state_dict, holdings,
                                         load_full_optimizer_state, load_full_state_dict,
                                         shard_runs)


@dataclass(frozen=True)
class Shard:
    """How one rank's parameter is cut from the full array.

    Along ``axis`` the full array is ``groups`` equal parts (3 for a fused q/k/v
    projection); each part is split over the ranks of ``comm`` by ``counts``, and this
    rank holds its piece of every part, concatenated.
    """

    axis: int
    counts: tuple[int, ...]
    comm: Communicator
    groups: int = 1

    @property
    def start(self) -> int:
        return sum(self.counts[: self.comm.rank])

    def take(self, full: Any) -> Any:
        """This rank's piece of the full array ``full`` (a new contiguous array)."""
        xp = get_array_module(full)
        n, c = sum(self.counts), self.counts[self.comm.rank]
        if full.shape[self.axis] != self.groups * n:
            raise ValueError(f"a full parameter of shape {tuple(full.shape)} has "
                             f"{full.shape[self.axis]} rows along axis {self.axis}; this "
                             f"layer's shards add up to {self.groups} x {n}")
        x = xp.moveaxis(full, self.axis, 0)
        x = x.reshape((self.groups, n) + x.shape[1:])[:, self.start:self.start + c]
        x = x.reshape((self.groups * c,) + x.shape[2:])
        return xp.ascontiguousarray(xp.moveaxis(x, 0, self.axis))

    def gather(self, local: Any) -> Any:
        """The full array from every rank's ``local`` piece. Collective over ``comm``."""
        xp = get_array_module(local)
        if self.comm.size == 1:
            return local.copy()
        c = self.counts[self.comm.rank]
        x = xp.moveaxis(local, self.axis, 0)
        rest = x.shape[1:]
        x = xp.ascontiguousarray(x.reshape((self.groups, c) + rest).swapaxes(0, 1))
        full = self.comm.allgatherv(x)  # (n, groups, ...), rank-major
        full = full.swapaxes(0, 1).reshape((self.groups * sum(self.counts),) + rest)
        return xp.ascontiguousarray(xp.moveaxis(full, 0, self.axis))


def _sharded(full: Any, shard: Shard) -> Parameter:
    p = Parameter(shard.take(full))
    p.shard = shard
    return p


def check_same_layer(comm: Communicator, what: str, *arrays: Any) -> None:
    """Raise DistributedError on every rank unless all ranks passed the same arrays.

    Collective. Compares shapes, dtypes and a CRC-32 of the bytes: a layer built from
    another seed on one rank would otherwise train as a silently different model.
    """
    mine = [(tuple(a.shape), str(a.dtype), zlib.crc32(numpy.ascontiguousarray(as_numpy(a))))
            for a in arrays if a is not None]
    everyone = comm.allgather_obj(mine)
    comm.check(everyone[comm.rank] == everyone[0],
               f"{what}: this rank's full weights differ from rank 0's (shapes, dtypes, "
               "CRC-32 " f"{mine} vs {everyone[0]}); build the full layer with the same "
               "seed and sizes on every rank")


def shard_counts(n: int, comm: Communicator, what: str) -> tuple[int, ...]:
    """``split_counts(n, comm.size)``, or a ValueError naming ``what`` when a rank gets none."""
    if n < comm.size:
        raise ValueError(f"{what}={n} cannot be split over {comm.size} tensor-parallel "
                         f"ranks (each needs at least one); use at most {n} ranks")
    return tuple(split_counts(n, comm.size))


class ColumnParallelLinear(Module):
    """``y_r = x W_r^T + b_r``: the output features of ``linear`` split over ``comm``.

    Forward takes the replicated input ``(..., in)`` (or, with ``sequence_parallel``,
    this rank's sequence shard ``(B, T_r, in)``, gathered first, and again in backward
    rather than stored: :func:`~mpidl.parallel.mappings.gathered_linear`) and returns
    this rank's output features ``(..., out_r)``. Collective over ``comm`` in forward
    (sequence-parallel) and backward.

    Args:
        linear: the full layer, the same on every rank (compared at construction).
        comm: the tensor-parallel group.
        partition: output features per rank, per group (default: ``split_counts``).
        groups: the output axis is ``groups`` equal parts split alike (3 for q, k, v).
        sequence_parallel: the input is split along axis 1 (Megatron's sequence
            parallelism); forward then needs the full length.
    """

    def __init__(self, linear: Linear, comm: Communicator, *, partition: Sequence[int] = None,
                 groups: int = 1, sequence_parallel: bool = False) -> None:
        super().__init__()
        bias = linear.bias.data if linear.bias is not None else None
        check_same_layer(comm, "ColumnParallelLinear", linear.weight.data, bias)
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.partition = tuple(partition) if partition is not None else \
            shard_counts(linear.out_features // groups, comm, "output features")
        shard = Shard(0, self.partition, comm, groups)
        self.in_features = linear.in_features
        self.out_features = groups * self.partition[comm.rank]
        self.weight = _sharded(linear.weight.data, shard)
        self.bias = _sharded(bias, shard) if bias is not None else None

    def forward(self, x: Any, length: int | None = None) -> Tensor:
        """``x`` replicated, or this rank's sequence shard of a ``length``-long sequence."""
        if self.sequence_parallel:
            if length is None:
                raise ValueError("a sequence-parallel ColumnParallelLinear needs the full "
                                 "sequence length: forward(x, length=T)")
            return gathered_linear(self.comm, x, self.weight, self.bias, length)
        return linear(copy_to_region(self.comm, x), self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features} of {self.partition}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(Module):
    """``y = sum_r x_r W_r^T + b``: the input features of ``linear`` split over ``comm``.

    Forward takes this rank's input features ``(..., in_r)`` (a column-parallel layer's
    output) and returns the full output, replicated (or, with ``sequence_parallel``,
    reduce-scattered to this rank's sequence shard). The bias is replicated and added
    after the sum. Collective over ``comm`` in forward (and backward, sequence-parallel).

    Args:
        linear, comm, partition: as :class:`ColumnParallelLinear`, for input features.
        sequence_parallel: return this rank's sequence shard (axis 1).
    """

    def __init__(self, linear: Linear, comm: Communicator, *, partition: Sequence[int] = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        bias = linear.bias.data if linear.bias is not None else None
        check_same_layer(comm, "RowParallelLinear", linear.weight.data, bias)
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.partition = tuple(partition) if partition is not None else \
            shard_counts(linear.in_features, comm, "input features")
        self.in_features = self.partition[comm.rank]
        self.out_features = linear.out_features
        self.weight = _sharded(linear.weight.data, Shard(1, self.partition, comm))
        self.bias = linear.bias  # replicated: the very Parameter of the full layer

    def forward(self, x: Any) -> Tensor:
        y = linear(x, self.weight)  # this rank's partial sum
        if self.sequence_parallel:
            y = scatter_sequence(self.comm, y, axis=1)
        else:
            y = reduce_from_region(self.comm, y)
        if self.bias is None:
            return y
        # Sequence-parallel: each rank adds the bias to its own tokens only, so its
        # gradient is a partial sum that backward must add up over the group.
        b = copy_to_region(self.comm, self.bias) if self.sequence_parallel else self.bias
        return F.add(y, b)

    def extra_repr(self) -> str:
        return (f"{self.in_features} of {self.partition}, {self.out_features}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(Module):
    """An embedding table whose rows (the vocabulary) are split over ``comm``.

    Each rank looks up the ids in its row range (zeros for the others) and the group
    sums: ids ``(B, T)`` replicated -> ``(B, T, D)`` replicated, or with
    ``sequence_parallel`` reduce-scattered to this rank's sequence shard. Collective
    over ``comm`` in forward (and backward, sequence-parallel). Its ``weight`` is also
    the column-parallel output projection of a model that ties the two
    (:func:`vocab_parallel_cross_entropy` takes those logits).
    """

    def __init__(self, embedding: Embedding, comm: Communicator, *,
                 partition: Sequence[int] = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        check_same_layer(comm, "VocabParallelEmbedding", embedding.weight.data)
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.num_embeddings, self.dim = embedding.num_embeddings, embedding.dim
        self.partition = tuple(partition) if partition is not None else \
            shard_counts(self.num_embeddings, comm, "vocabulary")
        shard = Shard(0, self.partition, comm)
        self.vocab_start = shard.start
        self.weight = _sharded(embedding.weight.data, shard)

    def forward(self, ids: Any) -> Tensor:
        ids = as_input(ids)
        if self.comm.size == 1:
            e = F.embedding(ids, self.weight)
        else:
            xp = get_array_module(ids)
            local = ids - self.vocab_start
            mine = (local >= 0) & (local < self.partition[self.comm.rank])
            e = F.embedding(xp.where(mine, local, 0), self.weight)
            e = F.mul(e, mine[..., None].astype(self.weight.dtype))
        if self.sequence_parallel:
            return scatter_sequence(self.comm, e, axis=1)
        return reduce_from_region(self.comm, e)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} of {self.partition}, {self.dim}"


# -- gradient norm over shards ----------------------------------------------------------
def grad_norm(params: Iterable[Tensor], comm: Communicator) -> Any:
    """The 2-norm of the full model's gradient, as a 0-d array, the same on every rank.

    Sharded parameters' squares are summed over ``comm`` (the tensor group), replicated
    ones counted once (:func:`mpidl.optim.clip.gradient_norm`). Collective over
    ``comm``. Call it after the gradients are averaged over the replicas.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return None
    return gradient_norm(((p.grad, getattr(p, "shard", None) is not None) for p in params),
                         tensor=comm)


def clip_grad_norm_(params: Iterable[Tensor], max_norm: float, comm: Communicator,
                    eps: float = 1e-6) -> Any:
    """:func:`mpidl.optim.clip_grad_norm_` with the norm of :func:`grad_norm`. Collective."""
    params = list(params)
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    norm = grad_norm(params, comm)
    if norm is not None:
        coef = get_array_module(norm).minimum(max_norm / (norm + eps), 1.0).astype(norm.dtype)
        for p in params:
            if p.grad is not None:
                p.grad *= coef
    return norm


__all__ = [
    "Shard", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "full_state_dict", "load_full_state_dict",
    "full_optimizer_state", "load_full_optimizer_state",
    "grad_norm", "clip_grad_norm_",
    "check_same_layer", "shard_runs", "holdings",
]
