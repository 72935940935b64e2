"""Sharded data parallelism (ZeRO, Rajbhandari et al. 2020): model state split over ranks.

Data parallelism keeps the parameters, the gradients and the optimizer state whole on
every rank: with Adam in float32, 16 bytes per parameter. :class:`ShardedDataParallel`
splits them over the ``N`` ranks of the group, exactly (the same numbers as data
parallelism, up to the order of float sums)::

    sdp = ShardedDataParallel(model, comm, stage=2)
    opt = AdamW(sdp.parameters(), lr=1e-3)       # the optimizer sees this rank's shards
    for x, y, n in loader:
        loss = softmax_cross_entropy(sdp(x), y, reduction="sum")
        sdp.backward(loss, global_count=n)       # gradients: this rank's shard of the mean
        sdp.clip_grad_norm_(1.0)                 # the global norm, over every shard
        opt.step()                               # updates this rank's shard only
        opt.zero_grad()

The parameters are grouped into *units*, each one flat buffer padded to a multiple of
``N`` elements; rank ``r`` owns block ``r`` of every unit, and :meth:`parameters`
returns one Parameter per unit viewing that block (elementwise optimizers, SGD, Adam,
AdamW, update it as they would any parameter):

- **stage 1**: optimizer state sharded. The gradients are reduce-scattered after backward
  (each rank gets the sum of its block; the full buffer stays allocated), the optimizer
  updates the block, and the next forward allgathers the updated blocks.
  Communication: reduce-scatter + allgather = one allreduce's volume.
- **stage 2**: also the gradients: the full gradient buffers are dropped once reduced, so
  no rank holds the full gradient after backward.
- **stage 3**: also the parameters. Units are the model's repeated blocks (the items of
  every ``ModuleList``) and the rest of the model; each unit's parameters are allgathered
  just before its forward, released after it, gathered again just before its backward
  (the next unit's gather is started early, non-blocking, to overlap compute), and its
  gradient is reduce-scattered and released as soon as backward has finished it.
  Tied parameters (GPT's embedding and output projection) sit in the model's own unit,
  gathered for the whole forward and backward. Communication: 1.5x data parallelism.
  The gathers and their schedule are :mod:`mpidl.parallel.zero_gather`'s.

Stage 3 asks the static graph FSDP asks: every rank's backward reaches the same
parameters in the same order (the gathers and reduce-scatters of backward are
collectives in that order). Gradient accumulation (:meth:`no_sync`) keeps full
gradients at stage 1 and reduce-scatters every micro-batch into the shards at stages 2
and 3 (which hold no full gradient). Embedding gradients are exchanged dense.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import numpy

from mpidl import backend
from mpidl.autograd import Tensor
from mpidl.comm.base import Communicator
from mpidl.nn.container import ModuleList
from mpidl.nn.module import Module, Parameter
from mpidl.optim.clip import gradient_norm
from mpidl.optim.layerwise import TensorNorms
from mpidl.parallel import agreement
from mpidl.parallel.buckets import plan_buckets
from mpidl.parallel.layerwise import unit_tensor_norms
from mpidl.parallel.transport import choose_transport
from mpidl.parallel.units import Unit, member_slices
from mpidl.parallel.wrapper import HeldBytes
from mpidl.parallel.zero_gather import Gathers

STAGES = (1, 2, 3)


class ShardedDataParallel:
    """Replicate ``model`` over ``comm`` with its state sharded: ZeRO ``stage`` 1, 2 or 3.

    Construction is collective: every rank builds the same model and passes the same
    options (checked, as :class:`~mpidl.parallel.DataParallel` does); rank 0's
    parameters are broadcast. Then :meth:`parameters` are this rank's shards: build the
    optimizer over them.

    Args:
        model: an :class:`mpidl.nn.Module`, built identically on every rank.
        comm: the replicas' communicator.
        stage: 1 (optimizer state), 2 (and gradients) or 3 (and parameters).
        bucket_mb: stages 1 and 2 group parameters into units of about this many MiB
            (the messages of the reduce-scatter and allgather), as DataParallel's buckets.
        compression: None, "float16" or "bfloat16": the dtype gradients travel in (the
            reduce-scatter); parameters always travel in full precision.
        broadcast: copy rank 0's parameters to every rank first.
        keep_freed_memory: as DataParallel's (glibc keeps freed memory for reuse; a
            process-wide setting, so the job's choice: off unless asked).
        broadcast_buffers: as DataParallel's: rank 0's running statistics of batch norm
            layers that are not synchronised go to every rank before each training
            forward (:func:`~mpidl.parallel.agreement.drifting_buffers`), so that every
            rank evaluates the same model.
        grad_dtype: None (gradients in the parameters' dtype) or "float32": the units'
            full gradients, so backward's accumulation and the reduce-scatter, sum in
            float32 (mixed precision with :class:`~mpidl.optim.MasterWeights`: the half
            shards are what forward uses and stage 3 gathers, the fp32 master shard
            lives with the optimizer state).
    """

    def __init__(self, model: Module, comm: Communicator, stage: int = 1,
                 bucket_mb: float = 4.0, compression: str | None = None,
                 broadcast: bool = True, keep_freed_memory: bool = False,
                 broadcast_buffers: bool = True, grad_dtype: str | None = None) -> None:
        self.comm, self.module = comm, model
        agreement.check_same_options(comm, "ShardedDataParallel", stage=stage,
                                     bucket_mb=bucket_mb, compression=compression,
                                     broadcast=broadcast, broadcast_buffers=broadcast_buffers,
                                     grad_dtype=grad_dtype)
        if grad_dtype not in (None, "float32"):
            raise ValueError(f"grad_dtype={grad_dtype!r}: use None (the parameters' dtype) "
                             "or 'float32'")
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r}: ZeRO stages are 1, 2 and 3")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be > 0 (MiB per unit)")
        if keep_freed_memory:
            backend.keep_freed_memory()
        self.stage = stage
        self._drifting = (agreement.drifting_buffers(model)
                          if broadcast_buffers and comm.size > 1 else [])
        self.named = list(model.named_parameters())
        agreement.check_same_parameters(comm, self.named)
        if broadcast:
            for _, p in self.named:
                comm.bcast_(p.data, root=0)
        self.piece_bytes = int(bucket_mb * 2**20)
        self.transport = choose_transport(comm, [], piece_bytes=self.piece_bytes,
                                          compression=compression if comm.size > 1 else None,
                                          shared_memory=False, owner="ShardedDataParallel")
        self.units = self._make_units(model)
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        for u in self.units:
            if grad_dtype is not None:
                u.grad_dtype = numpy.dtype(grad_dtype)
            self._shard(u)
        self.gathers = Gathers(comm, self.transport, self.units, model)
        self._stale = False       # shards updated since the last gather (stages 1, 2)
        self._syncing = True
        self._in_backward = False
        # Stage 3 reduces the units in one order on every rank: backward's (the forward
        # order reversed), each once it and all before it are final. Reducing each as
        # soon as it is final would let a rank whose batch left a parameter without a
        # gradient reduce in another order: a silent mis-sum where the sizes match.
        self._reduce_order: list[Unit] = []
        self._next_reduce = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_final)
                         for _, p in self.named]
        if stage == 3:
            self._handles += self.gathers.install_hooks()
        self.comm_wait_seconds = 0.0
        self.comm_wait_start = 0.0

    # -- units and shards --------------------------------------------------------------------
    def _make_units(self, model: Module) -> list[Unit]:
        params = [p for _, p in self.named]
        if self.stage < 3:
            groups = [[params[i] for i in g] for g in plan_buckets(params, self.piece_bytes)]
            return [Unit(i, g, self.comm.size, self.comm.rank) for i, g in enumerate(groups)]
        # Stage 3: every ModuleList item is a unit; the model's own unit holds the rest.
        blocks = [m for _, container in model.named_modules()
                  if isinstance(container, ModuleList) for m in container]
        taken: set[int] = set()
        units = []
        for m in blocks:
            mine = [p for _, p in m.named_parameters() if id(p) not in taken]
            if mine:
                taken.update(id(p) for p in mine)
                units.append((m, mine))
        rest = [p for p in params if id(p) not in taken]
        if rest:
            units.insert(0, (model, rest))
        return [Unit(i, ps, self.comm.size, self.comm.rank, module=m)
                for i, (m, ps) in enumerate(units)]

    def _shard(self, u: Unit) -> None:
        """Move ``u``'s parameters into its flat buffer; make this rank's block its shard."""
        flat = u.new_flat()
        for p, a, b in zip(u.params, u.offsets, u.offsets[1:]):
            flat[a:b] = p.data.reshape(-1)
        u.shard = Parameter(flat[u.start:u.start + u.block].copy() if self.stage == 3
                            else flat[u.start:u.start + u.block],
                            name=f"zero.unit{u.index}")
        if self.stage == 3:
            for p in u.params:
                p.releasable = True  # the graph refers to it, not to its array
            u.release_params()
        else:
            u.point_params_at(flat)

    def parameters(self) -> list[Parameter]:
        """This rank's shards, one Parameter per unit: what the optimizer updates."""
        return [u.shard for u in self.units if u.block]

    # -- gathering parameters (mpidl.parallel.zero_gather) -----------------------------------
    @property
    def peak_gathered_bytes(self) -> int:
        """The most full parameters, gradients and prefetches held at once (stage 3's
        transient memory on top of the shards)."""
        return self.gathers.peak_bytes

    _block_scale: float | None = None  # 1/N for a backward without global_count

    def gather_parameters(self) -> None:
        """Bring the model's parameters up to date with the shards (stages 1 and 2: after
        an optimizer step). Collective; done by the next forward by itself."""
        if self.stage < 3 and self._stale:
            self.gathers.refresh()
            self._stale = False

    # -- backward ----------------------------------------------------------------------------
    def before_forward(self) -> None:
        """What a forward of the model needs first (stages 1-2: the updated parameters),
        for a caller that runs another method of the model than ``forward`` (``gpt``'s
        split loss), and rank 0's drifting buffers in training. Collective."""
        self.gather_parameters()
        if self._drifting and self.module.training:
            for b in self._drifting:
                self.comm.bcast_(b, root=0)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.before_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate over micro-batches: pass the total sample count to every backward.

        Stage 1 keeps full gradients and reduces at the last backward; stages 2 and 3
        reduce-scatter every micro-batch into the shards (they hold no full gradient).
        """
        previous = self._syncing
        self._syncing = self.stage > 1  # stages 2-3 always reduce into the shards
        try:
            yield
        finally:
            self._syncing = previous

    def backward(self, loss: Tensor, global_count: int | None = None,
                 scale: float = 1.0) -> None:
        """Backward of this rank's summed ``loss``; each shard's ``.grad`` becomes this
        rank's block of the global mean (``global_count`` samples in all). Collective."""
        xp = loss.xp
        seed = (scale / global_count) if global_count else scale
        # Without global_count each rank's loss is its own mean: the sum over ranks is
        # divided by N. Each reduced block is divided as it arrives, not the shard's
        # gradient afterwards: under no_sync stages 2-3 add every micro-batch's block
        # to the shard, and dividing the sum so far again after each one would shrink
        # the earlier micro-batches (|g| 1.99 against DataParallel's 2.67 at 2 ranks).
        self._block_scale = (1.0 / self.comm.size
                             if not global_count and self.comm.size > 1 else None)
        for u in self.units:
            # Stage 3 allocates a unit's full gradient only when backward reaches it
            # (_before_backward); the model's own unit is reached first and last.
            if u.grad_flat is None and (self.stage < 3 or u.module is self.module):
                u.attach_grads(u.new_grad_flat())
            u.pending, u.reduced = len(u.params), False
        self._reduce_order = [u for u in reversed(self.gathers.order)
                              if u.module is not self.module]
        self._next_reduce = 0
        self._in_backward = True
        try:
            loss.backward(xp.full(loss.shape, seed, dtype=loss.dtype))
        finally:
            self._in_backward = False
        t0 = time.perf_counter()
        if self._syncing:
            rest = self._reduce_order[self._next_reduce:]
            for u in rest + [u for u in self.units if u not in rest]:  # the same order on
                if not u.reduced:                                      # every rank
                    self._reduce(u)
            self._stale = self.stage < 3
        self.comm_wait_start = t0
        self.comm_wait_seconds = time.perf_counter() - t0

    def _on_grad_final(self, p: Tensor) -> None:
        if not (self._in_backward and self._syncing and self.stage == 3):
            return
        u = self._unit_of.get(id(p))
        if u is None:
            return
        u.pending -= 1
        order = self._reduce_order
        while self._next_reduce < len(order) and order[self._next_reduce].pending == 0:
            self._reduce(order[self._next_reduce])
            self._next_reduce += 1

    def _reduce(self, u: Unit) -> None:
        """Reduce-scatter the unit's gradient into its shard's ``.grad`` (collective);
        stages 2 and 3 then drop the full gradient, stage 3 the full parameters too."""
        if u.grad_flat is None:  # backward never reached it: zeros, summed like the rest
            u.attach_grads(u.new_grad_flat())
        u.fill_missing()
        block = self.transport.reduce_scatter(u.grad_flat)
        if self._block_scale is not None:
            block *= self._block_scale
        if u.shard.grad is None:  # as autograd: gradients add up until zero_grad()
            u.shard.grad = block
        else:
            u.shard.grad += block
        u.reduced = True
        if self.stage >= 2:
            u.drop_grads()
        else:
            for p in u.params:  # the full buffer stays; the next backward overwrites it
                p.grad = None
            u.attach_grads(u.grad_flat)
        if self.stage == 3:
            u.release_params()

    # -- gradient norm -----------------------------------------------------------------------
    def grad_norm(self, tensor: Communicator | None = None) -> Any:
        """The 2-norm of the whole (averaged) gradient, from every rank's shard. Collective.

        ``tensor``: the group that a tensor-parallel model's parameters are split over
        (those with a ``shard``, :mod:`mpidl.parallel.tensor`): their squares add up over
        it too, while the replicated parameters, alike on every rank of it, count once
        (:func:`mpidl.optim.clip.gradient_norm`, the norm of every layout).
        """
        pieces = [(g, tensor is not None and getattr(p, "shard", None) is not None)
                  for u in self.units if u.block and u.shard.grad is not None
                  for p, _, g in member_slices(u, u.shard.grad)]
        xp = self.units[0].xp if self.units else numpy
        # A 0-d xp array: reading it would wait for the device every step (#48).
        return gradient_norm(pieces, shards=self.comm, tensor=tensor, xp=xp)

    def tensor_norms(self, tensor: Communicator | None = None) -> TensorNorms:
        """Where the model's tensors are among :meth:`parameters` (this rank's shards), for
        LARS and LAMB: their norms add up over the replicas (and ``tensor`` for
        tensor-parallel members). Not collective."""
        return unit_tensor_norms(self.units, self.comm, tensor)

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6,
                        tensor: Communicator | None = None) -> Any:
        """Scale the shards' gradients so the global norm (:meth:`grad_norm`) is at most
        ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_`` on the whole model).
        Collective."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        norm = self.grad_norm(tensor)
        # On the device and unconditional, as optim.clip_grad_norm_: no host read.
        xp = backend.get_array_module(norm)
        coef = xp.minimum(max_norm / (norm + eps), 1.0)
        for s in self.parameters():
            if s.grad is not None:
                s.grad *= coef.astype(s.grad.dtype)
        return norm

    # -- memory ------------------------------------------------------------------------------
    def state_bytes(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank holds now in parameters, gradients and optimizer state."""
        held = HeldBytes()
        params = held(*(u.flat for u in self.units),
                      *(u.shard.data for u in self.units if u.shard is not None))
        grads = held(*(u.grad_flat for u in self.units),
                     *(u.shard.grad for u in self.units if u.shard is not None))
        return {"parameters": params, "gradients": grads, "optimizer": held.optimizer(optimizer)}

    def close(self) -> None:
        """Detach the hooks and release the transport. Collective."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.transport.close()


__all__ = ["ShardedDataParallel", "STAGES"]
