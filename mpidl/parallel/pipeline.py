"""Pipeline parallelism: a model's parts on the stages of a grid's pipeline axis.

    grid = ProcessGrid(world, pipeline=4, tensor=2)           # data = world.size // 8
    model = pipeline_gpt(grid, microbatches=8, schedule="1f1b", **gpt_kwargs)
    opt = AdamW(model.parameters(), lr=1e-3)
    for ids in batches:                                       # this data rank's (B, T + 1)
        loss_sum, count = model.step(ids)                     # forward + backward, all of it
        opt.step(); opt.zero_grad()                           # loss: loss_sum / count

:class:`PipelineModel` runs one step's schedule (:mod:`mpidl.parallel.pipeline_schedule`:
gpipe, 1f1b, interleaved) on this rank's parts. The batch is cut into ``m`` microbatches
by :func:`~mpidl.comm.split_counts` (uneven splits allowed: every stage knows every
microbatch's shape, so no shape is ever exchanged). A forward of part ``k`` receives the
activation ``(b_i, T_here, D)`` from part ``k - 1`` and sends its output to part ``k + 1``;
a backward receives the output gradient and sends the input gradient.

The loss is a sum (mpidl's convention): the last part's backward is seeded with
``scale / global_count``, as :meth:`DataParallel.backward` seeds any loss, so the loss
is divided once, by the global number of targets, not per microbatch; every part runs
its forwards and its backwards in microbatch order 0..m-1, so each gradient accumulates
in the order single-rank gradient accumulation over the same split does (float64:
equal bit for bit on a GPT, tests/unit/test_pipeline.py). The parts of a stage are one
module, wrapped for data parallelism over :attr:`ProcessGrid.replicas` (DataParallel, or
any :class:`~mpidl.parallel.wrapper.Wrapper`, ZeRO-1 included); every backward but the
stage's last runs under ``no_sync``, so the reduction happens once per step and, for
every stage but the first, while the stages before it drain (the cool-down).

The messages between stages, their tags and why their order cannot deadlock:
:mod:`mpidl.parallel.pipeline_messages`.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Protocol, Sequence

import numpy

from mpidl import functions as F
from mpidl.autograd import Tensor, no_grad
from mpidl.backend import as_numpy, get_array_module
from mpidl.comm.base import Communicator, split_counts
from mpidl.nn.container import ModuleList
from mpidl.nn.module import Module, Parameter
from mpidl.nn.recompute import saved_bytes
from mpidl.parallel import pipeline_state
from mpidl.parallel.data import DataParallel
from mpidl.parallel.grid import ProcessGrid
from mpidl.parallel.pipeline_messages import StageMessages
from mpidl.parallel.pipeline_schedule import Action, messages, schedule as make_schedule
from mpidl.parallel.tensor import grad_norm
from mpidl.parallel.zero import ShardedDataParallel


class Part(Protocol):
    """What the engine asks of one model part (a :class:`~mpidl.nn.Module`).

    Attributes:
        index: the part's number ``k`` (it runs on stage ``k % p``).
        first, last: it takes the ids (no activation) / it returns the summed loss.
        dtype: the dtype of the activations it receives.
        tied_out: on part 0, a Parameter the last part (on another stage) also uses, or None.
        tied_in: on the last part, ``(shape, dtype)`` of that weight, or None; the
            engine sets ``tied_weight`` (a Tensor) before the step's forwards.
        hits: on the last part, after each forward, this rank's share of the
            microbatch's next-token hits (0 where a part does not count them).
    """

    index: int
    first: bool
    last: bool
    dtype: Any
    tied_out: Parameter | None
    tied_in: tuple | None

    def __call__(self, x: Tensor | None, ids: Any) -> Tensor:
        """Forward: the previous part's output (None for part 0) and the microbatch's
        ids -> this part's output, or (last part) this rank's summed loss."""

    def input_shape(self, ids: Any) -> tuple[int, ...]:
        """The shape of the activation this part receives for microbatch ``ids``."""

    def count_targets(self, ids: Any) -> int:
        """How many targets of ``ids`` count in the loss."""

    def full_names(self) -> dict[str, str]:
        """Its parameters' names -> the single-rank model's names (for the state)."""


class Stage(Module):
    """This rank's parts as one module (what the data-parallel wrapper wraps)."""

    def __init__(self, parts: Sequence[Module]) -> None:
        super().__init__()
        self.parts = ModuleList(parts)

    def half_(self, dtype: Any) -> "Stage":
        """Each part's ``half_`` (a part knows the dtype of what it receives)."""
        for part in self.parts:
            part.half_(dtype)
        return self


class PipelineModel:
    """This rank's parts of a pipelined model, and the step that runs the schedule.

    Construction is collective over the world: the parts are wrapped for data
    parallelism over ``grid.replicas`` (collective there), and the layout is agreed.

    Args:
        grid: the process grid; its pipeline axis holds the stages.
        parts: the parts of stage ``grid.pipeline_rank``, in order (``v`` of them:
            parts ``r, r + p, ...``).
        schedule: "gpipe", "1f1b" or "interleaved" (needs ``v > 1`` to interleave).
        microbatches: ``m``, at least the number of stages.
        wrapper: ``wrapper(module, comm) -> Wrapper`` for data parallelism over
            ``grid.replicas`` (default :class:`~mpidl.parallel.DataParallel`; ZeRO-1:
            ``lambda m, c: ShardedDataParallel(m, c, stage=1)``; stage 2 works too, with
            a reduce-scatter per microbatch; stage 3 is refused: DistributedError on every rank).
        names: the single-rank model's parameter names in order (the order of
            :meth:`full_state_dict`); None: the parts' order.

    Attributes:
        module: the :class:`Stage` of this rank's parts; ``wrapped``: its wrapper.
        actions: this rank's schedule (:class:`~mpidl.parallel.pipeline_schedule.Action`).
        peak_activation_bytes: after :meth:`step`, the most bytes of part outputs
            (the activations sent to the next part, one per microbatch in flight) this
            rank held at once.
        measure_graphs: set True to count, during :meth:`step`, the bytes every
            part-microbatch's graph holds until its backward (a walk of each graph:
            for tests and benchmarks); ``peak_graph_bytes``: their most at once.
        step_seconds, wait_seconds: after :meth:`step`, its wall time (without the
            final loss broadcast) and the part of it this rank waited for messages:
            ``wait / (step - wait)`` is its measured bubble.
        hits: after :meth:`step` or :meth:`evaluate`, this rank's share of the batch's
            next-token hits, counted by the last part and the same on every stage (as
            the loss share).
    """

    def __init__(self, grid: ProcessGrid, parts: Sequence[Any], *, schedule: str = "1f1b",
                 microbatches: int, wrapper: Callable[[Module, Communicator], Any] | None = None,
                 names: Sequence[str] | None = None) -> None:
        p, v = grid.pipeline_size, len(parts)
        everyone = grid.world.allgather_obj((schedule, microbatches, v))
        grid.world.check(all(e == everyone[0] for e in everyone),
                         "PipelineModel: schedule, microbatches and parts per stage differ "
                         "between ranks: " + ", ".join(
                             f"rank {r} {e}" for r, e in enumerate(everyone))
                         + "; pass the same on every rank")
        self.grid, self.p, self.v, self.m = grid, p, v, microbatches
        self.schedule = schedule
        self.parts_total = p * v
        self.actions = make_schedule(schedule, p, microbatches, v)[grid.pipeline_rank]
        self.parts = {part.index: part for part in parts}
        if sorted(self.parts) != list(range(grid.pipeline_rank, p * v, p)):
            raise ValueError(f"PipelineModel: stage {grid.pipeline_rank} of {p} holds parts "
                             f"{sorted(self.parts)}; with {v} per stage it must hold "
                             f"{list(range(grid.pipeline_rank, p * v, p))}")
        self.module = Stage(parts)
        if get_array_module(next(iter(self.module.parameters())).data) is not numpy:
            grid.pipeline.prepare_device()  # collective: device messages need the path
        if wrapper is None:
            def wrapper(module: Module, comm: Communicator) -> Any:
                return DataParallel(module, comm)
        self.wrapped = wrapper(self.module, grid.replicas)
        zero3 = isinstance(self.wrapped, ShardedDataParallel) and self.wrapped.stage > 2
        grid.world.check(not zero3, (
            "PipelineModel with ZeRO stage 3: ZeRO-3 gathers a unit's parameters only "
            "inside its module's forward and backward, and the pipeline reads them "
            "outside (the tied embedding sent to the last stage, the full state); use "
            "ZeRO stage 1 or 2 per stage (DeepSpeed refuses ZeRO 2-3 with pipelines)"))
        self.names = list(names) if names is not None else None
        self.peak_activation_bytes = self.peak_graph_bytes = 0
        self.measure_graphs = False
        self.step_seconds = 0.0
        self.hits = 0
        self.posted_ahead = 0  # the last step's receives posted while an earlier action ran
        self.messages = StageMessages(grid.pipeline, p, self.parts_total, self.module)
        self._last_backward = max(i for i, a in enumerate(self.actions) if a.kind == "B")

    @property
    def wait_seconds(self) -> float:
        """The time the last :meth:`step` waited for messages (its bubble)."""
        return self.messages.wait_seconds

    # -- the step --------------------------------------------------------------------------
    def parameters(self) -> list:
        """What the optimizer updates: the wrapper's parameters (this stage's)."""
        return self.wrapped.parameters()

    @property
    def training(self) -> bool:
        """Whether this stage's parts are in training mode (dropout on), as a Module's."""
        return self.module.training

    def train(self, mode: bool = True) -> "PipelineModel":
        self.module.train(mode)
        return self

    def eval(self) -> "PipelineModel":
        return self.train(False)

    def step(self, ids: Any, global_count: int | None = None,
             scale: float = 1.0) -> tuple[float, int]:
        """Forward and backward of the whole schedule on this data rank's batch ``ids``
        (its next-token hits in :attr:`hits` after).

        Collective over the world (every rank of a data replica passes the same ``ids``;
        each data rank its own). Leaves each stage's gradients, reduced over
        ``grid.replicas``, on :meth:`parameters`: the gradient of the summed loss times
        ``scale / global_count``. ``global_count``: the targets of the global batch
        (default: counted here, one allreduce over the data axis).

        Returns:
            ``(loss_sum, global_count)``: this rank's share of the summed loss of its
            batch (as ParallelGPT.loss shares it over tensor and sequence ranks; the
            same on every stage), and the global count it was divided by.
        """
        grid, wrapped = self.grid, self.wrapped
        started, self.messages.wait_seconds = time.perf_counter(), 0.0
        micro = self._microbatches(ids)
        if global_count is None:
            any_part = next(iter(self.parts.values()))
            mine = numpy.array([sum(any_part.count_targets(mb) for mb in micro)],
                               dtype=numpy.int64)
            global_count = int(grid.data.allreduce_(mine)[0])
        wrapped.before_forward()
        sends: list = []
        tied = self._exchange_tied(sends)
        held: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        loss_sum, hits, live, peak = 0.0, 0, 0, 0
        graph: dict[tuple[int, int], int] = {}
        graphs, self.peak_graph_bytes = 0, 0
        posted: set[int] = set()
        self.posted_ahead = 0  # receives posted while an earlier action ran
        for index, action in enumerate(self.actions):
            self._post_next(index, micro, held, posted)
            mb = micro[action.microbatch]
            got, sent = messages(action, self.parts_total)
            if action.kind == "F":
                x, out = self._forward(action, mb, sends)
                if sent is not None:
                    live += out.data.nbytes
                    peak = max(peak, live)
                else:  # summed on the device, read once after the schedule (#48)
                    loss_sum = loss_sum + out.data
                    hits = hits + getattr(self.parts[action.part], "hits", 0)
                held[(action.part, action.microbatch)] = (x, out)
                if self.measure_graphs:
                    graph[(action.part, action.microbatch)] = size = self._graph_bytes(x, out)
                    graphs += size
                    self.peak_graph_bytes = max(self.peak_graph_bytes, graphs)
                continue
            x, out = held.pop((action.part, action.microbatch))
            graphs -= graph.pop((action.part, action.microbatch), 0)
            sync = contextlib.nullcontext() if index == self._last_backward else wrapped.no_sync()
            with sync:
                if got is None:  # the last part: the loss, divided once
                    wrapped.backward(out, global_count=global_count, scale=scale)
                else:
                    grad = self.messages.receive(out.data.shape, out.data.dtype, got)
                    # sum(out * grad) has gradient grad * 1.0 = grad exactly: the
                    # wrapper's declared backward(loss) takes it like any loss.
                    surrogate = F.sum(F.mul(out, Tensor(grad)))
                    if action.part == 0 and tied is not None and index == self._last_backward:
                        surrogate = F.add(surrogate, self._tied_gradient_term())
                    wrapped.backward(surrogate, global_count=1, scale=1.0)
            if got is not None:
                live -= out.data.nbytes
            if sent is not None:
                sends.append(self.messages.send(x.grad, sent))
            if action.part == self.parts_total - 1 and tied is not None \
                    and action.microbatch == self.m - 1:
                sends.append(self.messages.send_tied_gradient(tied.grad))
        for request in sends:
            self.messages.waited(request)
        self.peak_activation_bytes = peak
        self.step_seconds = time.perf_counter() - started
        return self._from_last_stage(loss_sum, hits), global_count

    def _from_last_stage(self, loss_sum: Any, hits: Any) -> float:
        """The last stage's loss share (returned) and hits (:attr:`hits`), on every
        stage: one broadcast over the pipeline axis (exact: hits are < 2**53).

        ``loss_sum`` and ``hits`` are the last stage's device sums (0 elsewhere): read
        here once a step, not at every microbatch (a host read waits for the device)."""
        if get_array_module(loss_sum, hits) is not numpy:
            xp = get_array_module(loss_sum, hits)
            total = as_numpy(xp.stack([xp.asarray(loss_sum, dtype=numpy.float64),
                                       xp.asarray(hits, dtype=numpy.float64)]))
        else:
            total = numpy.array([loss_sum, hits], dtype=numpy.float64)
        self.grid.pipeline.bcast_(total, root=(self.parts_total - 1) % self.p)
        self.hits = int(total[1])
        return float(total[0])

    def evaluate(self, ids: Any) -> tuple[float, int]:
        """This rank's share of the summed loss of ``ids`` and its count of targets,
        forward only, keeping no graph. Collective over the world as :meth:`step`; the
        loss is the same on every stage.

        Every rank runs its parts' forwards microbatch by microbatch, parts in order:
        each forward's input comes from a forward earlier in that (microbatch, part)
        order, so no rank waits on one that waits on it.
        """
        self.wrapped.before_forward()
        micro = self._microbatches(ids)
        loss_sum, hits, sends = 0.0, 0, []
        self._exchange_tied(sends)
        with no_grad():
            for i, mb in enumerate(micro):
                for k in sorted(self.parts):
                    _, out = self._forward(Action("F", k, i), mb, sends)
                    if k == self.parts_total - 1:
                        loss_sum += float(out.data)
                        hits += int(getattr(self.parts[k], "hits", 0))
        for request in sends:
            request.wait()
        loss_sum = self._from_last_stage(loss_sum, hits)
        count = sum(next(iter(self.parts.values())).count_targets(mb) for mb in micro)
        return loss_sum, count

    def clip_grad_norm_(self, max_norm: float, eps: float = 1e-6) -> Any:
        """Scale every stage's gradients so the whole model's 2-norm is at most
        ``max_norm``; returns the norm before (a 0-d xp array). Collective over the world.

        Each stage's norm is its wrapper's (ZeRO: over the shards) or its parameters'
        (tensor-parallel shards adding up over the tensor group, replicated parameters
        once); the stages' squares add up over the pipeline axis. The tied weight is
        one parameter, of part 0, so it counts once.
        """
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        if isinstance(self.wrapped, ShardedDataParallel):
            stage = self.wrapped.grad_norm(self.grid.tensor)
        else:
            stage = grad_norm(self.wrapped.parameters(), self.grid.tensor)
        params = [p for p in self.wrapped.parameters() if p.grad is not None]
        xp = get_array_module(stage, *params)
        # On the device, as optim.clip_grad_norm_: the squares reduced over the pipeline
        # axis and the factor applied unconditionally, no host read (#48).
        squares = xp.zeros(1, dtype=numpy.float64)
        if stage is not None:
            squares += xp.asarray(stage, dtype=numpy.float64) ** 2
        norm = xp.sqrt(self.grid.pipeline.allreduce_(squares)[0])
        coef = xp.minimum(max_norm / (norm + eps), 1.0)
        for param in params:
            param.grad *= coef.astype(param.grad.dtype)
        return norm

    def state_bytes(self, optimizer: Any = None) -> dict[str, int]:
        """Bytes this rank holds now (its stage's; see the wrapper's ``state_bytes``)."""
        return self.wrapped.state_bytes(optimizer)

    def close(self) -> None:
        """Release the wrapper's resources. Collective over the replicas."""
        self.wrapped.close()

    def _microbatches(self, ids: Any) -> list:
        """``ids`` cut into ``m`` microbatches along axis 0 (:func:`split_counts`)."""
        ids = numpy.asarray(ids) if get_array_module(ids) is numpy else ids
        rows = split_counts(int(ids.shape[0]), self.m)
        starts = [sum(rows[:i]) for i in range(self.m + 1)]
        return [ids[starts[i]:starts[i + 1]] for i in range(self.m)]

    def _post_next(self, index: int, micro: list, held: dict, posted: set) -> None:
        """Post the receives of the actions from ``index`` on, in schedule order, up to
        the first one after ``index``: that one waits while action ``index`` runs
        (:meth:`StageMessages.post`). An activation's shape is the microbatch's, a
        gradient's that of the output it is the gradient of, known once that forward
        has run; where it is not known yet, nothing later is posted either, so that
        the receives of one peer and tag are posted in the order they are sent."""
        for j in range(index, len(self.actions)):
            nxt = self.actions[j]
            got, _ = messages(nxt, self.parts_total)
            if got is None or j in posted:
                continue
            if nxt.kind == "F":
                part = self.parts[nxt.part]
                shape, dtype = part.input_shape(micro[nxt.microbatch]), part.dtype
            else:
                pair = held.get((nxt.part, nxt.microbatch))
                if pair is None:
                    return
                shape, dtype = pair[1].data.shape, pair[1].data.dtype
            self.messages.post(shape, dtype, got)
            posted.add(j)
            if j > index:
                self.posted_ahead += 1
                return

    def _forward(self, action: Action, mb: Any, sends: list) -> tuple[Tensor | None, Tensor]:
        """Receive the input of forward ``action``, run it, post its output's send."""
        part = self.parts[action.part]
        got, sent = messages(action, self.parts_total)
        x = None
        if got is not None:
            x = Tensor(self.messages.receive(part.input_shape(mb), part.dtype, got),
                       requires_grad=True)
        out = part(x, mb)
        if sent is not None:
            sends.append(self.messages.send(out.data, sent))
        return x, out

    @staticmethod
    def _graph_bytes(x: Tensor | None, out: Tensor) -> int:
        """What one part-microbatch holds until its backward: the arrays its graph saved
        (:func:`mpidl.nn.recompute.saved_bytes`) and its received input."""
        return saved_bytes(out) + (0 if x is None else int(x.data.nbytes))

    def _exchange_tied(self, sends: list) -> Tensor | None:
        """The tied weight from part 0 to the last part (:meth:`StageMessages.exchange_tied`)."""
        return self.messages.exchange_tied(self.parts.get(0),
                                           self.parts.get(self.parts_total - 1), sends)

    def _tied_gradient_term(self) -> Tensor:
        """``sum(tok.weight * g)``, g the last part's gradient of the tied weight: its
        backward adds g to ``tok.weight``'s gradient in part 0's last backward."""
        w = self.parts[0].tied_out
        return F.sum(F.mul(w, Tensor(self.messages.receive_tied_gradient(w))))

    # -- state (mpidl.parallel.pipeline_state) -----------------------------------------------
    def full_state_dict(self) -> dict[str, Any]:
        """The single-rank model's state dict, on every rank. Collective over the world."""
        return pipeline_state.full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Load a single-rank state dict into this rank's parts (not collective)."""
        pipeline_state.load_full_state_dict(self, state)

    def full_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The single-rank optimizer's state dict, from this stage's ``optimizer``.
        Collective over the world."""
        return pipeline_state.full_optimizer_state(self, optimizer)

    def load_full_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Load a single-rank optimizer state into this stage's ``optimizer``."""
        pipeline_state.load_full_optimizer_state(self, optimizer, state)


__all__ = ["Part", "PipelineModel", "Stage"]
