"""Flat gradient buckets: parameters' ``.grad`` are views into a few contiguous arrays.

One allreduce per bucket instead of one per parameter (a per-parameter allreduce pays
MPI's latency for every bias vector), and no packing copies: backward writes each
gradient straight into its slice of the bucket, so the bucket is ready to send the
moment its last gradient is final. The first contribution of a step is a copy into the
slice (``zero_grad()`` drops ``.grad``, see :attr:`Tensor.grad_buffer`), later ones add:
no zero-fill of the buckets and no read-add-write per step.

Parameters are assigned in *reverse* registration order, because backward produces
the last layer's gradients first: the first bucket fills first and its allreduce starts
while backward is still working through the earlier layers (PyTorch DDP does the same).
Each bucket holds one dtype: the parameters' own, or float32 for half-precision
parameters with fp32 gradients (``grad_dtype``, mixed precision: backward's
contributions, the microbatches' accumulation and the allreduce all sum in float32, as
Megatron requires for bfloat16). fp32 rather than 16-bit buckets reduced by an
upcasting op: MPI cannot add bfloat16, and the user-defined op that could took 2.9x
the time of MPI's own float32 allreduce of the same gradients (16 MiB at 2 ranks on one
node: 438 ms against 151 ms, benchmarks/half_reduce.py at load average 20), besides
rounding every partial sum. The assignment depends only on the parameter list and the
bucket size, so it is identical on every rank, and so is the order of the collectives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mpidl.backend import get_array_module


@dataclass
class Bucket:
    """A contiguous gradient buffer shared by several parameters.

    Attributes:
        index: position in the fixed launch order.
        flat: the 1-D xp array holding every member's gradient.
        params: the member parameters.
        views: each member's gradient view into ``flat`` (what ``.grad`` must be).
        pending: members whose gradient is not final yet in this backward pass.
        request: the in-flight non-blocking allreduce, if any.
        wire: the 16-bit host copy of ``flat`` when gradients are compressed.
    """

    index: int
    flat: Any
    params: list = field(default_factory=list)
    views: list = field(default_factory=list)
    pending: int = 0
    request: Any = None
    wire: Any = None

    @property
    def nbytes(self) -> int:
        return int(self.flat.nbytes)

    def attach(self) -> None:
        """Make each member's view its gradient buffer, and its ``.grad`` if it has one.

        A dropped gradient (``zero_grad()``) stays None: backward writes the next one
        straight into the view (:attr:`Tensor.grad_buffer`). A replaced one is copied in.
        """
        for p, view in zip(self.params, self.views):
            p.grad_buffer = view
            if p.grad is not None and p.grad is not view:
                view[...] = p.grad
                p.grad = view

    def rebind(self, flat: Any) -> None:
        """Move the bucket into ``flat`` (same size and dtype), values and gradients too."""
        flat[...] = self.flat
        old, self.flat, self.views = self.views, flat, _views(flat, self.params)
        for p, was, view in zip(self.params, old, self.views):
            if p.grad is was:
                p.grad = view
        self.attach()  # a gradient that was not the old view is copied in

    def fill_missing(self) -> None:
        """Zero the views of members that got no gradient, and make them ``.grad``.

        After backward: a parameter this rank's batch did not reach (an unused branch, an
        empty batch) still sums zeros into the allreduce and is updated by the optimizer
        with the other ranks' gradient, like on every other rank.
        """
        for p, view in zip(self.params, self.views):
            if p.grad is None:
                view[...] = 0
                p.grad = view


def plan_buckets(params: Sequence[Any], bucket_bytes: int,
                 grad_dtype: Any = None) -> list[list[int]]:
    """Group parameter indices into buckets of about ``bucket_bytes`` each.

    Walks the parameters in reverse order; a bucket closes when adding the next
    parameter would pass ``bucket_bytes`` (a single larger parameter gets a bucket of
    its own) or when the dtype changes. Bytes are the gradients' (``grad_dtype``, or
    the parameters' dtype when None). Pure function of shapes and dtypes.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    dtype = None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.data.nbytes if grad_dtype is None else p.data.size * grad_dtype.itemsize
        if current and (p.data.dtype != dtype or size + nbytes > bucket_bytes):
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        dtype = p.data.dtype
    if current:
        groups.append(current)
    return groups


def build_buckets(params: Sequence[Any], bucket_bytes: int,
                  grad_dtype: Any = None) -> list[Bucket]:
    """Allocate one zeroed flat array per bucket and attach the parameters' grads to it.

    Any gradient the parameters already hold is copied into the bucket, so building
    buckets in the middle of an accumulation loses nothing. ``grad_dtype``: the
    buckets' dtype (None: each parameter's own).
    """
    buckets = []
    for index, members in enumerate(plan_buckets(params, bucket_bytes, grad_dtype)):
        first = params[members[0]].data
        xp = get_array_module(first)
        total = sum(params[i].data.size for i in members)
        dtype = first.dtype if grad_dtype is None else grad_dtype
        bucket = Bucket(index=index, flat=xp.zeros(total, dtype=dtype),
                        params=[params[i] for i in members])
        bucket.views = _views(bucket.flat, bucket.params)
        bucket.attach()
        buckets.append(bucket)
    return buckets


def _views(flat: Any, params: Sequence[Any]) -> list:
    """Each parameter's gradient view into ``flat``, in order."""
    views, start = [], 0
    for p in params:
        views.append(flat[start:start + p.data.size].reshape(p.data.shape))
        start += p.data.size
    return views
