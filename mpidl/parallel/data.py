"""Data parallelism: one model replica per rank, gradients averaged with MPI allreduce.

The user's loop stays plain::

    dp = DataParallel(model, comm)
    opt = AdamW(model.parameters(), lr=1e-3)
    for x, y, n in loader:                  # this rank's share of a global batch of n
        loss = softmax_cross_entropy(dp(x), y, reduction="sum")
        dp.backward(loss, global_count=n)   # grads = mean over the global batch
        opt.step(); opt.zero_grad()

What happens inside:

- At construction every rank's parameter list (names, shapes, dtypes) is compared; a
  mismatch raises :class:`~mpidl.comm.DistributedError` on every rank naming the first
  differing parameter and the ranks. Then rank 0's parameters are broadcast.
- Gradients live in flat per-dtype buckets (``param.grad`` are views into them, see
  :mod:`mpidl.parallel.buckets`), so there are no packing copies. After backward each
  bucket's allreduce is issued in a fixed order, so every rank issues the same
  collectives in the same order.
- Overlap: buckets start their non-blocking allreduces during backward as they fill
  (:mod:`mpidl.parallel.overlap`), the default when the ranks span several nodes; on
  one node, one blocking allreduce per bucket after backward measured faster, so that
  is the default there.
- On one node (the common case for CPU training) the buckets live in an MPI-3
  shared-memory window: each rank sums its share of them out of the other ranks' copies
  and writes the sum into every copy (:mod:`mpidl.comm.shared`), no Allreduce per bucket.
- ``backward(loss, global_count=n)`` seeds backward with ``1/n`` instead of 1, so the
  allreduced *sum* is the mean over the global batch, with no extra pass over the
  gradients. Ranks with fewer samples (or none, in the last step of an epoch) simply
  contribute less: the result is the gradient of the whole global batch.
- Embedding tables can exchange only the rows a batch touched, chosen automatically per
  step: on one node inside the window's sum (each rank marks its rows, the owner of a
  share of rows sums only the marked ones when they are few), across nodes by MPI (see
  :mod:`mpidl.parallel.sparse`).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Iterator

import numpy

from mpidl import backend
from mpidl.autograd import Tensor
from mpidl.backend import get_array_module
from mpidl.comm.base import Communicator
from mpidl.nn import Embedding, EmbeddingBag
from mpidl.optim import clip_grad_norm_
from mpidl.optim.layerwise import TensorNorms
from mpidl.parallel import agreement
from mpidl.parallel.buckets import Bucket, build_buckets
from mpidl.parallel.compression_choice import PowerSGDOptions, parse_compression
from mpidl.parallel.layerwise import whole_tensor_norms
from mpidl.parallel.sparse import SparseTables
from mpidl.parallel.syncbn import convert_sync_batchnorm
from mpidl.parallel import compression as wire
from mpidl.parallel.overlap import BucketLauncher
from mpidl.parallel.transport import WindowTransport, choose_transport
from mpidl.parallel.wrapper import HeldBytes


class DataParallel:
    """Replicate ``model`` on every rank of ``comm`` and average its gradients.

    Construction is collective over ``comm``; wrapping a model again detaches its
    previous wrapper. The parameters' ``.grad`` are views of the buckets, rewritten every
    step: copy a gradient you keep across steps. :meth:`close` (collective) releases the
    buckets' shared memory; :meth:`remove_hooks` only detaches.

    Args:
        model: an :class:`mpidl.nn.Module`, built identically on every rank.
        comm: the communicator of the replicas (``mpidl.comm.world()``).
        bucket_mb: bucket size in MiB, and the largest message sent (a parameter
            larger than a bucket is sent in bucket-sized pieces). Measured with Open MPI
            over shared memory (2 ranks, benchmarks/README.md "Data parallel"): one
            allreduce moves 4-5 MiB fastest (about 6 GB/s) and halves its throughput
            above 6 MiB, and per-call latency is only ~2 us, so the default is 4 MiB
            (0.25-1 MiB buckets are not faster; 25 MiB, PyTorch's default, is slower).
            Multi-node networks may prefer larger; measure with benchmarks/gradsync.py.
        compression: None, "float16" or "bfloat16": the dtype gradients travel in.
            With ``hierarchical``, only between the node leaders (the network); the
            node-local reduce and broadcast stay in full precision. Or a
            :class:`~mpidl.parallel.PowerSGDOptions` (any value
            :func:`~mpidl.parallel.parse_compression` reads, "powersgd:4" too): each
            gradient matrix travels as a rank-r approximation with error feedback
            (:mod:`mpidl.parallel.powersgd`), without ``hierarchical``.
        hierarchical: node-local reduce, allreduce among node leaders, node-local
            broadcast (pass an int to group that many consecutive ranks per "node").
        sparse_embeddings: exchange only touched rows of embedding tables whose
            gradients are row-sparse (the default, chosen per step when cheaper).
        broadcast: copy rank 0's parameters to every rank at construction.
        overlap: start each bucket's non-blocking allreduce from backward's hooks as
            soon as it is full, polling ``test()`` from later hooks (True), or run one
            blocking allreduce per bucket after backward (False). None (the default)
            chooses: True when the ranks span more than one node, False when they all
            share one (mlp at 2 ranks on one node: 20.0 ms per step blocking, 21.3 ms
            overlapped). Every rank makes the same choice (it depends on the group only).
        keep_freed_memory: have glibc's malloc keep the memory a step frees for the next
            step (:func:`mpidl.backend.keep_freed_memory`). A process-wide setting, so the
            job's choice (``mpidl train`` asks for it: its ``keep_freed_memory`` key); the
            library leaves the allocator alone unless asked. Each step frees and
            reallocates the same activations; by default glibc returns them to the kernel
            and the next step page-faults them back in: the reference transformer at 2
            ranks trains at 249 samples/s without and 313 with it (benchmarks/README.md).
            The process keeps its peak heap, as a GPU framework's caching allocator does.
        shared_memory: keep the buckets in an MPI-3 shared-memory window, where each
            rank sums its share straight out of the other ranks' copies and writes the
            sum into all of them (:mod:`mpidl.comm.shared`), instead of an MPI Allreduce
            per bucket: the mlp's exchange in a 2-rank step took 0.58-0.61 ms against
            1.68-1.85 (benchmarks/dp_phases.py). Only when every rank shares one node,
            on host arrays, without compression, hierarchy or overlap; None (the
            default) uses it exactly then, True raises if it cannot, False never uses it.
        sync_batchnorm: replace the model's BatchNorm layers by SyncBatchNorm over
            ``comm`` first (:func:`mpidl.parallel.convert_sync_batchnorm`): statistics of
            the global batch, running statistics identical on every rank.
        broadcast_buffers: copy rank 0's buffers (running statistics of plain batch
            norm, which each rank would update from its own share) to every rank before
            each training forward, as PyTorch DDP does; synced batch norm needs none.
        grad_dtype: None (gradients in each parameter's dtype) or "float32": the
            buckets, so backward's accumulation, the microbatches' and the allreduce,
            sum in float32 whatever the parameters' dtype (mixed precision with
            :class:`~mpidl.optim.MasterWeights`: half parameters, fp32 gradients, as
            Megatron's bf16 default; embedding tables then travel dense too).
    """

    def __init__(self, model: Any, comm: Communicator, bucket_mb: float = 4.0,
                 compression: str | None = None, hierarchical: bool | int = False,
                 sparse_embeddings: bool = True, broadcast: bool = True,
                 overlap: bool | None = None, keep_freed_memory: bool = False,
                 shared_memory: bool | None = None, sync_batchnorm: bool = False,
                 broadcast_buffers: bool = True, grad_dtype: str | None = None) -> None:
        self.comm = comm
        # First the agreement (collective), then the values: an option that only some
        # ranks got wrong is a DistributedError everywhere, not an error on those ranks
        # while the others wait; one that all got wrong is the same ValueError everywhere.
        agreement.check_same_options(comm, "DataParallel", bucket_mb=bucket_mb,
                                     compression=compression, hierarchical=hierarchical,
                                     sparse_embeddings=sparse_embeddings, broadcast=broadcast,
                                     overlap=overlap, shared_memory=shared_memory,
                                     sync_batchnorm=sync_batchnorm,
                                     broadcast_buffers=broadcast_buffers, grad_dtype=grad_dtype)
        if grad_dtype not in (None, "float32"):
            raise ValueError(f"grad_dtype={grad_dtype!r}: use None (the parameters' dtype) "
                             "or 'float32'")
        if isinstance(compression, str) and compression not in wire.WIRE_DTYPES:
            compression = parse_compression(compression)  # ValueError naming the choices
        if compression is not None and not isinstance(compression, PowerSGDOptions) \
                and compression not in wire.WIRE_DTYPES:
            raise ValueError(f"compression={compression!r}: use None or one of {wire.WIRE_DTYPES}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0 (MiB per gradient bucket)")
        if keep_freed_memory:
            backend.keep_freed_memory()
        if sync_batchnorm and comm.size > 1:
            convert_sync_batchnorm(model, comm)  # before the parameter list is taken
        self.module = model
        self.bucket_mb = bucket_mb
        # Rank 0's drifting buffers (batch norm's running statistics) are broadcast
        # before every training forward, as PyTorch DDP does.
        self._drifting = (agreement.drifting_buffers(model)
                          if broadcast_buffers and comm.size > 1 else [])
        self.compression = compression if comm.size > 1 else None
        self.named = list(model.named_parameters())
        agreement.check_same_parameters(comm, self.named)
        # Wrapping a model again replaces its wrapper, which would otherwise keep its
        # hooks and buckets on the same parameters: once this one is complete (a
        # construction that fails leaves the old wrapper working), the old one is
        # closed, its shared window freed. Collective like this constructor.
        previous = _WRAPPERS.get(id(model))
        self._detached = False
        if broadcast:
            self.broadcast_parameters()

        params = [p for _, p in self.named]
        # fp32 gradients of half tables stay in the buckets: the sparse row exchange
        # would sum them in the tables' dtype, and MPI has no bfloat16.
        self.grad_dtype = None if grad_dtype is None else numpy.dtype(grad_dtype)
        self.sparse = [p for p in params if sparse_embeddings and self.grad_dtype is None
                       and is_row_sparse(model, p)]
        dense = [p for p in params if not any(p is s for s in self.sparse)]
        self._piece_bytes = int(bucket_mb * 2**20)
        self.buckets: list[Bucket] = build_buckets(dense, self._piece_bytes, self.grad_dtype)
        # Each table's gradient has a flat of its own, which backward writes in place (no
        # fresh 10 MB array per step); on one node the window sums it with the buckets,
        # by the rows the ranks touched, in the same two fences.
        self.table_buckets = [build_buckets([p], p.data.nbytes)[0] for p in self.sparse]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.sparse_tables = SparseTables(self.sparse)

        # local_size < size on every rank exactly when some rank is on another node.
        self.overlap = overlap if overlap is not None else comm.local_size < comm.size
        # How the buckets travel, chosen once (mpidl.parallel.transport).
        every = self.buckets + self.table_buckets
        flats = [b.flat for b in every]
        self.transport = choose_transport(
            comm, flats, piece_bytes=self._piece_bytes, compression=self.compression,
            hierarchical=hierarchical, overlap=self.overlap, shared_memory=shared_memory,
            shapes=[[tuple(p.data.shape) for p in b.params] for b in every])
        rows = [None] * len(self.buckets) + [p.data.shape[0] for p in self.sparse]
        for b, flat in zip(every, self.transport.bind(flats, rows)):
            if flat is not b.flat:
                b.rebind(flat)
        masks = self.transport.row_masks
        # Where each table's touched rows go for the window's sum; None: the tables
        # travel apart, by SparseTables.sync (MPI: rows or dense, decided per step).
        self._table_masks = None if masks is None else masks[len(self.buckets):]
        self.launcher = BucketLauncher(self.buckets, self.transport, self.overlap)
        self._syncing = True
        self._in_backward = False
        self.comm_wait_seconds = 0.0  # time the last backward blocked on communication
        self.comm_wait_start = 0.0  # its time.perf_counter() start (for timelines)
        # whether the last sync summed some table by its touched rows alone (on one node,
        # where each rank decides for its own share of the rows: this rank's choice)
        self.sparse_used = False
        if previous is not None and previous.module is model:
            previous.close()  # detaches its hooks and buckets from the parameters ...
            for b in every:
                b.attach()  # ... which are this wrapper's again
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_final)
                         for _, p in self.named]
        _WRAPPERS[id(model)] = self  # only once complete: a failed construction is not one

    def broadcast_parameters(self, root: int = 0) -> None:
        """Overwrite every rank's parameters with root's. Collective."""
        for _, p in self.named:
            self.comm.bcast_(p.data, root=root)

    def broadcast_optimizer_state(self, optimizer: Any, root: int = 0) -> None:
        """Give every rank root's optimizer state (after resuming on root only). Collective.

        Root's ``state_dict()`` layout (keys, shapes, dtypes, scalars) is broadcast as
        metadata, the arrays through the buffer API, then every rank loads it.
        """
        state = optimizer.state_dict() if self.comm.rank == root else {}
        layout = {k: (tuple(v.shape), str(v.dtype)) if hasattr(v, "shape") else ("scalar", v)
                  for k, v in state.items()}
        layout = self.comm.bcast_obj(layout, root=root)
        xp = get_array_module(self.named[0][1].data) if self.named else None
        new = {}
        for key, (shape, meta) in layout.items():
            if shape == "scalar":
                new[key] = meta
                continue
            arr = xp.ascontiguousarray(state[key]) if self.comm.rank == root else \
                xp.empty(shape, dtype=meta)
            new[key] = self.comm.bcast_(arr, root=root)
        optimizer.load_state_dict(new)

    # -- forward / backward ---------------------------------------------------------------
    def before_forward(self) -> None:
        """What a forward of the model needs first (rank 0's running statistics of the
        batch norm layers that are not synchronised), for a caller that runs another
        method of the model than ``forward``. Collective."""
        if self._drifting and self.module.training:
            for b in self._drifting:
                self.comm.bcast_(b, root=0)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before_forward()
        return self.module(*args, **kwargs)

    def parameters(self) -> list:
        """The model's parameters: what the optimizer updates (ShardedDataParallel's
        are this rank's shards instead)."""
        return self.module.parameters()

    def clip_grad_norm_(self, max_norm: float) -> Any:
        """Clip the averaged gradients to a global 2-norm of ``max_norm``; returns the
        norm before. Not collective: every rank holds the same gradients already."""
        return clip_grad_norm_(self.parameters(), max_norm)

    def tensor_norms(self, tensor: Communicator | None = None) -> TensorNorms:
        """Where the model's tensors are among :meth:`parameters`, for LARS and LAMB:
        each a whole tensor, or with ``tensor`` a tensor-parallel shard whose norm adds
        up over that group (:mod:`mpidl.parallel.layerwise`). Not collective."""
        return whole_tensor_norms(self.parameters(), tensor)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next ``backward`` outside syncs them all.

        For gradient accumulation over micro-batches: pass the *total* sample count of
        all micro-batches as ``global_count`` to every ``backward`` in the cycle.
        """
        previous = self._syncing
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = previous

    def backward(self, loss: Tensor, global_count: int | None = None,
                 scale: float = 1.0) -> None:
        """Backward of ``loss`` with overlapped gradient allreduce.

        Collective (unless inside :meth:`no_sync`). ``loss`` is this rank's *sum* of
        per-sample losses; ``global_count`` is the number of samples in the global batch
        (all ranks together), so the gradients become the mean over the global batch.
        Without ``global_count``, ``loss`` is taken as already normalised and the
        gradients are summed over ranks and divided by ``size`` (the mean of per-rank
        means, right only when every rank has the same number of samples). ``scale``
        multiplies the gradients (loss scaling for float16: the seed of backward is
        ``scale / global_count``, so it costs nothing; see
        :class:`mpidl.optim.DynamicLossScale`).
        """
        if self._detached:
            raise RuntimeError("DataParallel.backward after remove_hooks() or close(): this "
                               "wrapper no longer owns the gradients; wrap the model again")
        xp = loss.xp
        seed = (scale / global_count) if global_count else scale
        self.launcher.begin()
        for b in self.table_buckets:
            b.attach()
        self._in_backward = True
        try:
            loss.backward(xp.full(loss.shape, seed, dtype=loss.dtype))
        finally:
            self._in_backward = False
        for b in self.buckets:
            b.fill_missing()
        for b in self.table_buckets:
            b.fill_missing()
        self.sparse_tables.record()
        if not self._syncing:
            return
        t0 = time.perf_counter()
        self.sync_gradients()
        if not global_count and self.comm.size > 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad *= 1.0 / self.comm.size
        self.comm_wait_start = t0
        self.comm_wait_seconds = time.perf_counter() - t0

    def sync_gradients(self) -> None:
        """Sum the gradients of the backward passes since the last sync over the ranks.

        What :meth:`backward` does after its pass outside :meth:`no_sync`; callable on
        its own after a ``no_sync`` backward (benchmarks/dp_phases.py times it so).
        Collective. Sets :attr:`sparse_used`.
        """
        if self._table_masks is not None:  # one window sums buckets and tables together
            self.sparse_tables.mark(self._table_masks)
            self.sparse_used = self.launcher.finish()
        else:
            self.launcher.finish()
            self.sparse_used = self.sparse_tables.sync(self.comm, self._piece_bytes)

    def _on_grad_final(self, p: Tensor) -> None:
        if self._in_backward and self._syncing and self.overlap:
            self.launcher.ready(self._bucket_of.get(id(p)))

    def state_bytes(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank holds now: full parameters, the gradient buckets (and any
        gradient outside them, the sparse tables'), and the optimizer's state."""
        held = HeldBytes()
        params = held(*(p.data for _, p in self.named))
        grads = held(*(b.flat for b in self.buckets + self.table_buckets),
                     *(p.grad for _, p in self.named))
        return {"parameters": params, "gradients": grads, "optimizer": held.optimizer(optimizer)}

    def checksum(self) -> float:
        """Sum of every parameter value in float64, on this rank (not collective)."""
        total = 0.0
        for _, p in self.named:
            total += float(p.data.astype("float64").sum())
        return total

    def remove_hooks(self) -> None:
        """Detach from the model (its parameters' ``.grad`` keep their values).

        Collective: frees the hierarchical communicators, if any. The buckets (and the
        ``.grad`` views) move out of the shared window into private memory, but the
        window stays mapped until :meth:`close` or the end of the process, so arrays
        taken from ``.grad`` earlier stay valid. Calling it again does nothing.
        """
        if self._detached:
            return
        self._detached = True
        for h in self._handles:
            h.remove()
        self._handles = []
        if isinstance(self.transport, WindowTransport) and self.transport.window is not None:
            for b in self.buckets + self.table_buckets:
                b.rebind(numpy.empty_like(b.flat))  # rebind copies the values over
            self.transport.retire()  # still mapped: .grad arrays kept earlier view it
        elif not isinstance(self.transport, WindowTransport):
            self.transport.close()
        for b in self.buckets + self.table_buckets:
            for p in b.params:
                p.grad_buffer = None
        if _WRAPPERS.get(id(self.module)) is self:
            del _WRAPPERS[id(self.module)]

    def close(self) -> None:
        """:meth:`remove_hooks`, then release the shared window's memory. Collective.

        Arrays taken from ``.grad`` before the wrapper was detached must not be used
        afterwards: on one node they point into the window, which is unmapped here.
        """
        self.remove_hooks()
        self.transport.close()


# id(model) -> its DataParallel; an entry lives as long as that wrapper (which holds the
# model, so the id cannot be reused meanwhile).
_WRAPPERS: "weakref.WeakValueDictionary[int, DataParallel]" = weakref.WeakValueDictionary()


def is_row_sparse(model: Any, p: Tensor) -> bool:
    """Whether ``p`` is only ever an embedding table (so its gradient is row-sparse).

    A table tied to a dense use (an output projection sharing the embedding weight)
    gets a dense gradient, so it must stay in the dense buckets.
    """
    holders = [m for _, m in model.named_modules()
               if any(v is p for v in vars(m).get("_parameters", {}).values())]
    return bool(holders) and all(isinstance(m, (Embedding, EmbeddingBag)) for m in holders)
