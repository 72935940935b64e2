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

Stage 3 asks the static graph FSDP asks: every rank's backward reaches the same
parameters in the same order (the gathers and reduce-scatters of backward are
collectives in that order). Gradient accumulation (:meth:`no_sync`) keeps full
gradients at stage 1 and reduce-scatters every micro-batch into the shards at stages 2
and 3 (which hold no full gradient). Embedding gradients are exchanged dense.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy

from mpidl import backend
from mpidl.autograd import Function, Tensor
from mpidl.backend import get_array_module
from mpidl.comm.base import Communicator
from mpidl.nn.module import Module, Parameter
from mpidl.optim.clip import gradient_norm
from mpidl.parallel import agreement
from mpidl.parallel.buckets import plan_buckets
from mpidl.parallel.transport import choose_transport
from mpidl.parallel.wrapper import HeldBytes

STAGES = (1, 2, 3)


class Unit:
    """Parameters gathered, reduced and sharded together: one flat buffer.

    Attributes:
        index: position in the unit order (the same on every rank).
        params: the member parameters, in flat order.
        size: their elements in all; ``padded`` rounds it up to a multiple of the ranks.
        shard: this rank's block of the flat parameters, the optimizer's Parameter.
        module: the module whose forward gathers it (stage 3), else None.
    """

    def __init__(self, index: int, params: list[Parameter], ranks: int, rank: int,
                 module: Module | None = None) -> None:
        self.index, self.params, self.module = index, params, module
        self.size = sum(int(p.data.size) for p in params)
        self.block = -(-self.size // ranks) if self.size else 0
        self.padded = self.block * ranks
        self.start = rank * self.block  # this rank's block: [start, start + block)
        self.shapes = [tuple(p.data.shape) for p in params]
        first = params[0].data
        self.xp, self.dtype = get_array_module(first), first.dtype
        self.offsets = numpy.cumsum([0] + [int(p.data.size) for p in params]).tolist()
        self.flat_itemsize = first.itemsize
        self.flat: Any = None        # the full padded parameters, when held
        self.grad_flat: Any = None   # the full padded gradient, while backward fills it
        self.shard: Parameter | None = None
        self.pending = 0
        self.request: Any = None     # an allgather in flight (stage 3 prefetch)
        self.reduced = False

    # -- the full flat parameters ------------------------------------------------------------
    def new_flat(self) -> Any:
        return self.xp.zeros(self.padded, dtype=self.dtype)

    def point_params_at(self, flat: Any) -> None:
        """Make each member's ``.data`` its view of ``flat`` (the full parameters)."""
        self.flat = flat
        for p, a, b, shape in zip(self.params, self.offsets, self.offsets[1:], self.shapes):
            p.data = flat[a:b].reshape(shape)

    def release_params(self) -> None:
        """Drop the full parameters (stage 3): members keep an empty placeholder."""
        self.flat = None
        empty = self.xp.empty(0, dtype=self.dtype)
        for p in self.params:
            p.data = empty

    # -- gradients ---------------------------------------------------------------------------
    def attach_grads(self, flat: Any) -> None:
        """Backward writes each member's gradient into its view of ``flat``."""
        self.grad_flat = flat
        for p, a, b, shape in zip(self.params, self.offsets, self.offsets[1:], self.shapes):
            view = flat[a:b].reshape(shape)
            p.grad_buffer = view
            if p.grad is not None and p.grad is not view:
                view[...] = p.grad
                p.grad = view

    def fill_missing(self) -> None:
        """Zero the gradient of members that got none (so every rank sums alike)."""
        for p, a, b, shape in zip(self.params, self.offsets, self.offsets[1:], self.shapes):
            if p.grad is None:
                view = self.grad_flat[a:b].reshape(shape)
                view[...] = 0
                p.grad = view

    def drop_grads(self) -> None:
        self.grad_flat = None
        for p in self.params:
            p.grad = None
            p.grad_buffer = None


class _GatherForBackward(Function):
    """Identity in forward; in backward, gathers the unit's parameters first (stage 3)."""

    def forward(self, x):
        return x

    def backward(self, gy):
        self.owner._before_backward(self.unit)
        return gy


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
    """

    def __init__(self, model: Module, comm: Communicator, stage: int = 1,
                 bucket_mb: float = 4.0, compression: str | None = None,
                 broadcast: bool = True, keep_freed_memory: bool = False,
                 broadcast_buffers: bool = True) -> None:
        self.comm, self.module = comm, model
        agreement.check_same_options(comm, "ShardedDataParallel", stage=stage,
                                     bucket_mb=bucket_mb, compression=compression,
                                     broadcast=broadcast, broadcast_buffers=broadcast_buffers)
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
            self._shard(u)
        self._stale = False       # shards updated since the last gather (stages 1, 2)
        self._syncing = True
        self._in_backward = False
        self._order: list[Unit] = []   # stage 3: the units in forward order, as seen
        # Stage 3 reduces the units in one order on every rank: backward's (the forward
        # order reversed), each once it and all before it are final. Reducing each as
        # soon as it is final would let a rank whose batch left a parameter without a
        # gradient reduce in another order: a silent mis-sum where the sizes match.
        self._reduce_order: list[Unit] = []
        self._next_reduce = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_final)
                         for _, p in self.named]
        if stage == 3:
            for u in self.units:
                self._handles += [u.module.register_forward_pre_hook(self._pre_forward(u)),
                                  u.module.register_forward_hook(self._post_forward(u))]
        self.comm_wait_seconds = 0.0
        self.comm_wait_start = 0.0

    # -- units and shards --------------------------------------------------------------------
    def _make_units(self, model: Module) -> list[Unit]:
        params = [p for _, p in self.named]
        if self.stage < 3:
            groups = [[params[i] for i in g] for g in plan_buckets(params, self.piece_bytes)]
            return [Unit(i, g, self.comm.size, self.comm.rank) for i, g in enumerate(groups)]
        # Stage 3: every ModuleList item is a unit; the model's own unit holds the rest.
        from mpidl.nn.container import ModuleList

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

    # -- gathering parameters ----------------------------------------------------------------
    def _gather(self, u: Unit) -> None:
        """The unit's full parameters from every rank's shard (collective)."""
        if u.request is not None:
            flat = self._finish_gather(u)
        else:
            flat = self.transport.allgather(u.shard.data, u.flat if u.flat is not None
                                            else u.new_flat())
        u.point_params_at(flat)
        self._track()

    def _track(self) -> None:
        """Keep :attr:`peak_gathered_bytes`: the most full parameters, gradients and
        prefetches held at once (stage 3's transient memory on top of the shards)."""
        held = sum((0 if u.flat is None else u.flat.nbytes)
                   + (0 if u.grad_flat is None else u.grad_flat.nbytes)
                   + (0 if u.request is None else u.padded * u.flat_itemsize)
                   for u in self.units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)

    peak_gathered_bytes = 0
    _block_scale: float | None = None  # 1/N for a backward without global_count

    def _start_gather(self, u: Unit) -> None:
        """Start the unit's allgather without waiting for it (stage 3 prefetch)."""
        if u.request is None and u.flat is None:
            u.request = self.comm.iallgather(u.shard.data)
            self._track()

    def _finish_gather(self, u: Unit) -> Any:
        blocks = u.request.wait()
        u.request = None
        return blocks.reshape(-1)

    def gather_parameters(self) -> None:
        """Bring the model's parameters up to date with the shards (stages 1 and 2: after
        an optimizer step). Collective; done by the next forward by itself."""
        if self.stage < 3 and self._stale:
            for u in self.units:
                self.transport.allgather(u.shard.data, u.flat)
            self._stale = False

    # -- stage 3 hooks -----------------------------------------------------------------------
    def _pre_forward(self, u: Unit) -> Any:
        def hook(module: Module, args: tuple) -> None:
            if u not in self._order:
                self._order.append(u)
            self._gather(u)
            nxt = self._next_in(self._order, u, +1)
            if nxt is not None and nxt is not self.units[0]:
                self._start_gather(nxt)
        return hook

    def _post_forward(self, u: Unit) -> Any:
        def hook(module: Module, args: tuple, out: Any) -> Any:
            if u.module is not self.module:
                u.release_params()
            if not isinstance(out, Tensor) or not out.requires_grad:
                return None
            return _GatherForBackward.apply(out, owner=self, unit=u)
        return hook

    def _next_in(self, order: list[Unit], u: Unit, step: int) -> Unit | None:
        i = order.index(u) + step if u in order else -1
        return order[i] if 0 <= i < len(order) else None

    def _before_backward(self, u: Unit) -> None:
        if u.flat is None:
            self._gather(u)
        if u.grad_flat is None:
            u.attach_grads(u.new_flat())
            self._track()
        prev = self._next_in(self._order, u, -1)
        if prev is not None and prev.flat is None:
            self._start_gather(prev)

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
        import time

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
                u.attach_grads(u.new_flat())
            u.pending, u.reduced = len(u.params), False
        self._reduce_order = [u for u in reversed(self._order) if u.module is not self.module]
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
            u.attach_grads(u.new_flat())
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
                  for p, _, g in _member_slices(u, u.shard.grad)]
        xp = self.units[0].xp if self.units else numpy
        return float(gradient_norm(pieces, shards=self.comm, tensor=tensor, xp=xp))

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6,
                        tensor: Communicator | None = None) -> float:
        """Scale the shards' gradients so the global norm (:meth:`grad_norm`) is at most
        ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_`` on the whole model).
        Collective."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        norm = self.grad_norm(tensor)
        coef = min(max_norm / (norm + eps), 1.0)
        if coef < 1.0:
            for s in self.parameters():
                if s.grad is not None:
                    s.grad *= coef
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


def unit_layout(sdp: ShardedDataParallel) -> list[dict[str, Any]]:
    """Where each parameter's elements lie: per unit, the members' names and offsets and
    this rank's block (what a sharded checkpoint records)."""
    names = {id(p): n for n, p in sdp.named}
    return [{"unit": u.index, "size": u.size, "block": u.block, "start": u.start,
             "params": [names[id(p)] for p in u.params], "offsets": u.offsets,
             "shapes": [list(s) for s in u.shapes]} for u in sdp.units]


__all__ = ["ShardedDataParallel", "STAGES", "unit_layout", "holdings", "refresh_after_load"]


# -- sharded checkpoints: what this rank holds, as typed records -----------------------------

def holdings(sdp: ShardedDataParallel, optimizer: Any, runs_of: Any = None,
             owner_of: Any = None, buffer_owner: bool | None = None) -> tuple[list, list]:
    """The :class:`~mpidl.parallel.holdings.Held` records of this rank's blocks: each
    member parameter's part of the block, and the same part of each optimizer array
    (None: the model only). Not collective.

    Args:
        runs_of: ``(parameter, its shape here)`` -> the single-rank shape and the runs of
            its elements (:func:`mpidl.parallel.tensor.shard_runs` on a grid); default:
            the parameter is the single-rank one.
        owner_of: whether this rank writes a parameter's part (default: yes: the blocks
            are this rank's alone); a grid's unsplit parameters are written by one
            tensor rank.
        buffer_owner: whether this rank writes the buffers (held whole on every rank);
            default: rank 0 of the group.
    """
    from mpidl.parallel.holdings import (Key, clip, optimizer_int, optimizer_state, record,
                                         whole_runs)

    runs_of = runs_of or whole_runs
    owner_of = owner_of or (lambda p: True)
    names = {id(p): n for n, p in sdp.named}
    index = {id(s): i for i, s in enumerate(optimizer.params)} if optimizer is not None else {}
    held, ints = [], []
    for u in sdp.units:
        if not u.block:
            continue
        lo, hi = u.start, min(u.start + u.block, u.size)
        for p, a, b, shape in zip(u.params, u.offsets, u.offsets[1:], u.shapes):
            x, y = max(lo, a), min(hi, b)
            if x >= y:
                continue
            full, runs = runs_of(p, shape)
            runs, name, part = clip(runs, x - a, y - a), names[id(p)], slice(x - lo, y - lo)
            held.append(record(Key("model", name), full, u.dtype, runs,
                               lambda create, u=u, part=part: u.shard.data[part], owner_of(p)))
            if optimizer is None:
                continue
            i = index[id(u.shard)]
            dtype = numpy.dtype(optimizer.state_dtype(u.shard.data))
            for array in optimizer.state_arrays:
                held.append(record(Key("optimizer", name, array), full, dtype, runs,
                                   optimizer_state(optimizer, i, array, (u.block,), dtype,
                                                   part), owner_of(p)))
            for integer in optimizer.state_ints:
                ints.append(optimizer_int(optimizer, i, Key("optimizer", name, integer),
                                          owner_of(p)))
    writes = sdp.comm.rank == 0 if buffer_owner is None else buffer_owner
    for name, buf in sdp.module.named_buffers():
        full, runs = whole_runs(buf, tuple(buf.shape))
        held.append(record(Key("model", name), full, buf.dtype, runs,
                           lambda create, buf=buf: buf, writes))
    return held, ints


def refresh_after_load(sdp: ShardedDataParallel) -> None:
    """After this rank's blocks were set (a sharded checkpoint loaded): stages 1-2
    gather the full parameters from every rank's blocks. Collective."""
    sdp._stale = True
    sdp.gather_parameters()


# -- checkpoints: every rank's pieces of every parameter ------------------------------------

def _member_slices(u: Unit, block: Any) -> list[tuple[Parameter, int, Any]]:
    """(parameter, first element, values) of each member's part of ``block`` (this
    rank's block of unit ``u``, or an array shaped like it: its gradient, optimizer
    state)."""
    out = []
    lo, hi = u.start, min(u.start + u.block, u.size)
    for p, a, b in zip(u.params, u.offsets, u.offsets[1:]):
        x, y = max(lo, a), min(hi, b)
        if x < y:
            out.append((p, x - a, block[x - u.start:y - u.start]))
    return out


def _pieces_of(u: Unit, names: dict[int, str], block: Any) -> list[tuple[str, int, Any]]:
    """(parameter name, first element, values) of each member's part of ``block``."""
    return [(names[id(p)], start, values) for p, start, values in _member_slices(u, block)]


def state_pieces(sdp: "ShardedDataParallel", optimizer: Any) -> tuple[dict, dict]:
    """This rank's part of the model and optimizer state, keyed by parameter name.

    ``model[name] = {"start": e, "shape": full shape, "data": elements e..}`` for every
    parameter this rank's blocks touch (rank 0 adds the model's buffers whole);
    ``optimizer`` has ``step``, ``lr`` and
    ``state[name][array]`` pieces alike (and the per-parameter ints). Not collective:
    each rank writes its own (:mod:`mpidl.train.checkpoint` companions), nobody gathers.
    """
    names = {id(p): n for n, p in sdp.named}
    shapes = {names[id(p)]: list(s) for u in sdp.units for p, s in zip(u.params, u.shapes)}
    model: dict[str, Any] = {}
    if sdp.comm.rank == 0:  # buffers (running statistics, input scales) are not sharded:
        for name, b in sdp.module.named_buffers():  # rank 0's whole, as DP saves them
            b = numpy.asarray(backend.as_numpy(b))
            model[name] = {"start": 0, "shape": list(b.shape), "data": b.reshape(-1)}
    opt_state: dict[str, Any] = {}
    full = optimizer.state_dict()
    index = {id(s): i for i, s in enumerate(optimizer.params)}
    for u in sdp.units:
        if not u.block:
            continue
        for name, start, data in _pieces_of(u, names, u.shard.data):
            model[name] = {"start": start, "shape": shapes[name], "data": data}
        i = index[id(u.shard)]
        for array in getattr(optimizer, "state_arrays", ()):
            key = f"state.{i}.{array}"
            if key in full:
                for name, start, data in _pieces_of(u, names, full[key]):
                    opt_state.setdefault(name, {})[array] = {
                        "start": start, "shape": shapes[name], "data": data}
        for integer in getattr(optimizer, "state_ints", ()):
            key = f"state.{i}.{integer}"
            if key in full:
                for name, _, _ in _pieces_of(u, names, u.shard.data):
                    opt_state.setdefault(name, {})[integer] = int(full[key])
    return model, {"step": full["step"], "lr": full["lr"], "state": opt_state}


def load_full_state(sdp: "ShardedDataParallel", model: dict[str, Any],
                    optimizer_state: dict[str, Any] | None, optimizer: Any) -> None:
    """Set this rank's shards (and its optimizer's state) from full, data-parallel state:
    ``model`` by parameter name, ``optimizer_state`` in the optimizer's own layout over
    the model's parameters (``state.<i>.<name>``, ``i`` in ``model.named_parameters()``
    order), as :func:`mpidl.train.checkpoint.load_checkpoint` returns both for any
    checkpoint. Not collective. Stages 1-2 also refresh the full parameters."""
    xp = sdp.units[0].xp if sdp.units else numpy
    order = {n: i for i, (n, _) in enumerate(sdp.named)}
    names = {id(p): n for n, p in sdp.named}
    buffers = dict(sdp.module.named_buffers())
    missing = [n for n, _ in sdp.named if n not in model]
    missing += [n for n in buffers if n not in model]
    unexpected = [n for n in model if n not in order and n not in buffers]
    if missing or unexpected:
        raise KeyError(f"the state lacks parameters or buffers {missing[:5]} and has "
                       f"others {unexpected[:5]}" if unexpected else
                       f"the state lacks parameters or buffers {missing[:5]}")
    for name, b in buffers.items():
        v = numpy.asarray(backend.as_numpy(model[name]))
        if tuple(v.shape) != tuple(b.shape):
            raise ValueError(f"buffer {name!r} has shape {tuple(v.shape)} in the state, "
                             f"{tuple(b.shape)} in the model")
        b[...] = xp.asarray(v)  # in place: the module keeps its array
    new_opt: dict[str, Any] = {"step": 0, "lr": optimizer.lr}
    if optimizer_state is not None:
        new_opt.update(step=optimizer_state["step"], lr=optimizer_state["lr"])
    index = {id(s): i for i, s in enumerate(optimizer.params)}

    def unit_block(u: Unit, values: dict[str, Any]) -> Any:
        flat = numpy.zeros(u.padded, dtype=u.dtype)
        for p, a, b, shape in zip(u.params, u.offsets, u.offsets[1:], u.shapes):
            v = numpy.asarray(backend.as_numpy(values[names[id(p)]]))
            if tuple(v.shape) != tuple(shape):
                raise ValueError(f"parameter {names[id(p)]!r} has shape {tuple(v.shape)} in "
                                 f"the state, {tuple(shape)} in the model")
            flat[a:b] = v.reshape(-1)
        return flat[u.start:u.start + u.block]

    for u in sdp.units:
        if not u.block:
            continue
        u.shard.data[...] = xp.asarray(unit_block(u, model))
        if optimizer_state is None:
            continue
        i = index[id(u.shard)]
        first = order[names[id(u.params[0])]]
        for array in getattr(optimizer, "state_arrays", ()):
            per_param = {n: optimizer_state.get(f"state.{order[n]}.{array}")
                         for n in (names[id(p)] for p in u.params)}
            if all(v is not None for v in per_param.values()):
                new_opt[f"state.{i}.{array}"] = xp.asarray(unit_block(u, per_param))
        for integer in getattr(optimizer, "state_ints", ()):
            value = optimizer_state.get(f"state.{first}.{integer}")
            if value is not None:
                new_opt[f"state.{i}.{integer}"] = int(value)
    optimizer.load_state_dict(new_opt)
    if sdp.stage < 3:
        for u in sdp.units:  # every rank holds all blocks: its full parameters from them
            u.flat[...] = xp.asarray(_full_flat(u, model, names))
        sdp._stale = False


def _full_flat(u: Unit, model: dict[str, Any], names: dict[int, str]) -> Any:
    flat = numpy.zeros(u.padded, dtype=u.dtype)
    for p, a, b in zip(u.params, u.offsets, u.offsets[1:]):
        flat[a:b] = numpy.asarray(backend.as_numpy(model[names[id(p)]])).reshape(-1)
    return flat


def assemble(pieces: list[dict[str, Any]], order: list[str]) -> dict[str, Any]:
    """Full arrays by name from every rank's pieces (``{name: {start, shape, data}}``)."""
    out: dict[str, Any] = {}
    for name in order:
        parts = [p[name] for p in pieces if name in p]
        if not parts:
            raise KeyError(f"no piece of parameter {name!r} in any file")
        shape = tuple(parts[0]["shape"])
        flat = numpy.empty(int(numpy.prod(shape, dtype=numpy.int64)),
                           dtype=parts[0]["data"].dtype)
        covered = 0
        for part in parts:
            data = numpy.asarray(part["data"]).reshape(-1)
            flat[part["start"]:part["start"] + data.size] = data
            covered += data.size
        if covered != flat.size:
            raise ValueError(f"the pieces of {name!r} cover {covered} of {flat.size} elements")
        out[name] = flat.reshape(shape)
    return out


def pieces_to_full(model_pieces: list[dict[str, Any]], optimizer_pieces: list[dict[str, Any]],
                   order: list[str], buffers: Sequence[str] = ()
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every rank's pieces (as :func:`state_pieces` wrote them) back into full state:
    the model by name (parameters in ``order``, then the ``buffers``), the optimizer in
    its data-parallel layout (``state.<i>.<name>`` with ``i`` in ``order``), so that data
    parallelism, evaluation and any stage at any rank count load a sharded checkpoint
    alike."""
    model = assemble(model_pieces, [*order, *buffers])
    first = next((o for o in optimizer_pieces if o), {"step": 0, "lr": 0.0})
    optimizer: dict[str, Any] = {"step": first["step"], "lr": first["lr"]}
    states = [o.get("state", {}) for o in optimizer_pieces]
    kinds: dict[str, bool] = {}  # name of a state entry -> is it an array
    for st in states:
        for entries in st.values():
            for key, value in entries.items():
                kinds[key] = isinstance(value, dict)
    for i, name in enumerate(order):
        for key, is_array in kinds.items():
            if is_array:
                parts = [{name: st[name][key]} for st in states
                         if name in st and key in st[name]]
                if parts:
                    optimizer[f"state.{i}.{key}"] = assemble(parts, [name])[name]
            else:
                value = next((st[name][key] for st in states
                              if name in st and key in st[name]), None)
                if value is not None:
                    optimizer[f"state.{i}.{key}"] = int(value)
    return model, optimizer
