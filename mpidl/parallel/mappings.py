"""Communication as autograd Functions: each collective and its adjoint in backward.

The conjugate pairs of Megatron-LM (Shoeybi et al. 2019, ``f`` and ``g``; Korthikanti
et al. 2022 for the sequence-parallel pair), over a tensor-parallel group:

===========================  =============================  ===========================
function                     forward                        backward
===========================  =============================  ===========================
:func:`copy_to_region`       identity                       allreduce
:func:`reduce_from_region`   allreduce                      identity
:func:`gathered_linear`      allgather along the sequence,  allgather again, GEMMs,
                             then the column-parallel GEMM  reduce-scatter of dX
:func:`scatter_sequence`     reduce-scatter along the       allgather along it
                             sequence
===========================  =============================  ===========================

A column-parallel layer takes its replicated input through ``copy_to_region`` (each
rank's part of the input gradient is partial, backward sums them); a row-parallel
layer's partial outputs go through ``reduce_from_region``. With Megatron's sequence
parallelism the activations between the two are split along the sequence instead of
replicated, and the pair becomes an allgather / ``scatter_sequence``: the same
bytes as one allreduce (a ring allreduce is a reduce-scatter then an allgather), and
the LayerNorm and dropout between them see ``1/t`` of the tokens. The allgather is
fused with the column-parallel layer it feeds, which stores its input as the shard and
gathers it again in backward (:func:`gathered_linear`).

Every function is collective over ``comm`` in forward and in backward: each rank of the
group calls it at the same point of the same model. On a group of one rank they are the
identity and make no call. 16-bit activations are summed in float32 and rounded once
(their allgathers are pure moves: bfloat16 travels as its uint16 bits). Sequence splits follow :func:`mpidl.comm.split_counts` (the
first ``T % t`` ranks one token more), the rule of ``reduce_scatter``.
"""
from __future__ import annotations

from typing import Any

from mpidl.autograd import Function, Tensor
from mpidl.backend import compute_dtype, get_array_module, is_half
from mpidl.comm.base import Communicator
from mpidl.nn.linear import linear


def _allreduce(comm: Communicator, x: Any) -> Any:
    """``x`` summed over ``comm``; a 16-bit ``x`` summed in float32 and rounded once.

    MPI has no bfloat16 type (a bfloat16 sum is a TypeError on MPI, mpidl.comm.datatypes)
    and float16 sums run as a Python-level user op on host memory; in float32 the
    ``t`` partial sums of a row-parallel layer add up without a rounding per add (the
    dtype policy: reductions accumulate in fp32). Twice the bytes of the 16-bit sum,
    the cost Megatron's fp32 gradient allreduce accepts too.
    """
    if is_half(x.dtype):
        return comm.allreduce(x.astype(compute_dtype(x.dtype))).astype(x.dtype)
    return comm.allreduce(x)


class CopyToRegion(Function):
    def forward(self, x):
        return x

    def backward(self, gy):
        return _allreduce(self.comm, gy)


class ReduceFromRegion(Function):
    def forward(self, x):
        return _allreduce(self.comm, x)

    def backward(self, gy):
        return gy


def _gather_rows(comm: Communicator, x: Any, length: int, axis: int) -> Any:
    """Concatenate every rank's ``x`` along ``axis`` (``split_counts(length)[r]`` rows from r)."""
    xp = get_array_module(x)
    rows = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
    if length % comm.size == 0:  # equal shards: a plain allgather, no counts to exchange
        full = comm.allgather(rows).reshape((length,) + rows.shape[1:])
    else:
        full = comm.allgatherv(rows)
    return xp.moveaxis(full, 0, axis)


def _reduce_scatter_rows(comm: Communicator, x: Any, axis: int) -> Any:
    """Sum ``x`` over the ranks and keep this rank's rows along ``axis``."""
    xp = get_array_module(x)
    rows = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))
    if is_half(rows.dtype):  # summed in float32, as _allreduce
        mine = comm.reduce_scatter(rows.astype(compute_dtype(rows.dtype))).astype(rows.dtype)
    else:
        mine = comm.reduce_scatter(rows)
    return xp.moveaxis(mine, 0, axis)


class ScatterSequence(Function):
    def forward(self, x):
        return _reduce_scatter_rows(self.comm, x, self.axis)

    def backward(self, gy):
        return _gather_rows(self.comm, gy, self.length, self.axis)


class GatheredLinear(Function):
    """``gather_sequence(x) @ W^T + b`` that keeps only the shard ``x`` for backward.

    Korthikanti et al. 2022, section 4.2.2: the gathered ``(B, T, D)`` input of a
    column-parallel layer is the one activation of a sequence-parallel block that is
    not split ``t`` ways; it is gathered again in backward instead of being stored,
    one more allgather of ``B T D / t`` per layer and pass (Megatron-LM does the same).
    """

    owned_grads = (1, 2)  # GEMM and column-sum results: fresh arrays

    def forward(self, x, weight, bias):
        full = _gather_rows(self.comm, x, self.length, 1)
        y = get_array_module(full).matmul(full.reshape(-1, weight.shape[1]), weight.T)
        if bias is not None:
            y += bias
        return y.reshape(full.shape[:-1] + (weight.shape[0],))

    def backward(self, gy):
        xp = get_array_module(gy)
        x, weight = self.inputs[0].data, self.inputs[1].data
        _, nw, nb = self.needs_input_grad
        full = _gather_rows(self.comm, x, self.length, 1)  # again: it was not kept
        gy2 = gy.reshape(-1, weight.shape[0])
        gw = xp.matmul(gy2.T, full.reshape(-1, weight.shape[1])) if nw else None
        gb = gy2.sum(axis=0) if nb else None
        gx = xp.matmul(gy2, weight).reshape(full.shape)
        return _reduce_scatter_rows(self.comm, gx, 1), gw, gb


def _as_tensor(x: Any) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(x)


def copy_to_region(comm: Communicator, x: Any) -> Tensor:
    """``x`` unchanged; in backward its gradient is summed over ``comm`` (Megatron's f).

    Collective in backward. Also what a parameter replicated over ``comm`` goes through
    when each rank's gradient for it is a partial sum (a LayerNorm inside a
    sequence-parallel region sees only this rank's tokens).
    """
    if comm.size == 1:
        return _as_tensor(x)
    return CopyToRegion.apply(x, comm=comm)


def reduce_from_region(comm: Communicator, x: Any) -> Tensor:
    """``x`` summed over ``comm``; the gradient passes through unchanged (Megatron's g).

    Collective in forward: same shape and dtype on every rank.
    """
    if comm.size == 1:
        return _as_tensor(x)
    return ReduceFromRegion.apply(x, comm=comm)


def scatter_sequence(comm: Communicator, x: Any, axis: int = 1) -> Tensor:
    """``x`` summed over ``comm``, keeping this rank's sequence shard; backward: allgather.

    Collective in forward and backward; ``x`` has the same shape on every rank, and
    rank r keeps ``split_counts(x.shape[axis], comm.size)[r]`` of its rows along ``axis``.
    """
    if comm.size == 1:
        return _as_tensor(x)
    return ScatterSequence.apply(x, comm=comm, length=int(x.shape[axis]), axis=axis)


def gathered_linear(comm: Communicator, x: Any, weight: Any, bias: Any, length: int) -> Tensor:
    """``linear(gather_sequence(comm, x, length), weight, bias)``, storing only ``x``.

    The input of a sequence-parallel column-parallel layer: this rank's shard ``x``
    ``(B, T_r, D)`` is gathered along axis 1 in forward and again in backward (so the
    gathered copy never outlives a pass), and the input gradient is reduce-scattered.
    Collective over ``comm`` in forward (one allgather) and backward (an allgather and a
    reduce-scatter).
    """
    if comm.size == 1:
        return linear(x, weight, bias)
    return GatheredLinear.apply(x, weight, bias, comm=comm, length=int(length))


__all__ = ["copy_to_region", "reduce_from_region", "gathered_linear", "scatter_sequence"]
