"""Batch normalisation with the statistics of the global batch: SyncBatchNorm.

Under data parallelism each rank sees ``b`` of the ``N b`` samples of a step; a plain
:class:`~mpidl.nn.BatchNorm` then normalises with statistics of ``b`` samples, so N ranks
x b is no longer 1 rank x N b (and small per-rank batches, the norm for 3-D volumes,
give noisy statistics). :class:`SyncBatchNorm` sums the per-channel counts, sums and
sums of squares over the ranks in one float64 allreduce per layer in forward, and the
two sums the input gradient needs in one more in backward (see
:mod:`mpidl.functions.batchnorm` for the arithmetic). Per-rank batches may differ in
size, down to zero samples. The running statistics are computed on every rank from the
same allreduced sums, so once equal (the converter broadcasts rank 0's) they stay
identical across ranks by construction, with no further broadcast.

    model = convert_sync_batchnorm(model, comm)   # every BatchNorm -> SyncBatchNorm
    dp = DataParallel(model, comm)

Collective: in training mode every forward and backward through a SyncBatchNorm is a
collective over its communicator, so every rank runs the same number of training steps
through the model (an empty local batch included). Evaluation mode uses the running
statistics and communicates nothing (as PyTorch's).
"""
from __future__ import annotations

from typing import Any

from mpidl.autograd import Tensor
from mpidl.comm.base import Communicator
from mpidl.nn.module import Module
from mpidl.nn.norm import BatchNorm


class SyncBatchNorm(BatchNorm):
    """Batch normalisation over the batch of all ranks of ``comm`` (any input rank >= 2).

    Same arguments, parameters and buffers as :class:`~mpidl.nn.BatchNorm`, plus the
    communicator. Prefer :func:`convert_sync_batchnorm`, which gives the layers a
    communicator of their own.

    Args:
        comm: the data-parallel group. Its allreduces must not interleave with other
            collectives on the same communicator in a rank-dependent order; a
            communicator used only by batch norm layers (``comm.split(0)``) is safe.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 comm: Communicator, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         dtype=dtype)
        self.comm = comm

    def _allreduce(self, buf: Any) -> Any:
        # Collective over self.comm: every rank passes a float64 buffer of the same size.
        return self.comm.allreduce_(buf)

    def forward(self, x: Any) -> Tensor:
        return self._normalize(x, allreduce=self._allreduce if self.training else None)

    @classmethod
    def from_batchnorm(cls, bn: BatchNorm, comm: Communicator) -> "SyncBatchNorm":
        """A SyncBatchNorm holding ``bn``'s parameters and buffers (the same objects)."""
        dtype = next((a.dtype for a in (bn.weight, bn.running_mean) if a is not None), None)
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                  comm=comm, dtype=dtype)
        if bn.affine:
            new.weight, new.bias = bn.weight, bn.bias
        if bn.track_running_stats:
            new.running_mean, new.running_var = bn.running_mean, bn.running_var
            new.num_batches_tracked = bn.num_batches_tracked
        new.train(bn.training)
        return new

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ranks={self.comm.size}"


def convert_sync_batchnorm(model: Module, comm: Communicator) -> Module:
    """Replace every :class:`~mpidl.nn.BatchNorm` (1d/2d/3d) in ``model`` by a
    :class:`SyncBatchNorm` over ``comm``; returns the model (or the new layer, when
    ``model`` is itself a batch norm).

    The new layers keep the old ones' places, names, Parameter objects and buffer
    arrays, so the parameter order, an optimizer built before and the state dict are
    unchanged; the buffers (running statistics) are overwritten with rank 0's, so that
    they start, and then stay, identical on every rank (data parallelism broadcasts
    the parameters). They share one communicator split from ``comm`` (so their allreduces
    never interleave with data parallelism's non-blocking gradient allreduces on
    ``comm``, which a rank whose batch skipped a parameter may start in another order).
    Call it before wrapping the model in :class:`~mpidl.parallel.DataParallel`.

    Collective over ``comm``: every rank converts the same model.

    Raises:
        DistributedError: (on every rank) the ranks' models hold different numbers of
            batch norm layers.
    """
    targets = [(parent, name) for _, parent in model.named_modules()
               for name, child in list(parent._modules.items())
               if isinstance(child, BatchNorm) and not isinstance(child, SyncBatchNorm)]
    root = isinstance(model, BatchNorm) and not isinstance(model, SyncBatchNorm)
    count = len(targets) + int(root)
    counts = comm.allgather_obj(count)
    comm.check(len(set(counts)) == 1,
               f"convert_sync_batchnorm: the ranks' models hold different numbers of batch "
               f"norm layers ({', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}); "
               "build the same model on every rank")
    if count == 0:
        return model
    bn_comm = comm.split(0, comm.rank)
    converted = []
    for parent, name in targets:
        layer = SyncBatchNorm.from_batchnorm(parent._modules[name], bn_comm)
        setattr(parent, name, layer)
        converted.append(layer)
    if root:
        model = SyncBatchNorm.from_batchnorm(model, bn_comm)  # type: ignore[arg-type]
        converted.append(model)
    # From here on every rank updates its buffers from the same sums; start them equal.
    for layer in converted:
        for _, buf in layer.named_buffers():
            bn_comm.bcast_(buf, root=0)
    return model
