"""The point-to-point messages of a pipeline step: activations, gradients, the tied weight.

:class:`~mpidl.parallel.pipeline.PipelineModel` runs a schedule's actions; every action
that crosses a stage boundary is a message between neighbours on the grid's pipeline
axis (:func:`~mpidl.parallel.pipeline_schedule.messages` says which). :class:`StageMessages`
posts them, tags them, waits for them and times the waits (the measured bubble).

Message order, and why it cannot deadlock: every send is posted (``isend``) and never
waited for until the end of the step, and a receive waits only for the one message its
action needs, posted (``irecv_``, :meth:`StageMessages.post`) an action ahead where its
shape is known then, else just before. No rank ever blocks in a send, so two
neighbours cannot block on each other (the classic deadlock: both blocking-send first,
1F1B's steady state; the simulator shows it, :func:`~mpidl.parallel.pipeline_schedule.
simulate` with ``blocking_sends=True``); a receive waits for a send its peer makes after
only actions that the schedule validator and simulator have run to the end. Messages
carry tags (activation into part k ``2k``, gradient into part k ``2k + 1``, tied weight
``2P``, its gradient ``2P + 1``), a second guard: every schedule's ranks receive from a
peer in the order it sends (tests/unit/test_pipeline_schedule.py), so one tag would do.
Every message is checked for size (and under ``MPIDL_CHECK_COLLECTIVES=1`` shape and
dtype) on receipt, and the watchdog names the peer of a receive that waits too long.
"""
from __future__ import annotations

import time
from typing import Any

from mpidl.autograd import Tensor
from mpidl.backend import compute_dtype, get_array_module, is_half
from mpidl.comm.base import Communicator
from mpidl.nn.module import Module


class StageMessages:
    """One rank's messages to and from its neighbouring stages. Not collective: each
    method is one side of a point-to-point exchange on ``comm``.

    Args:
        comm: the grid's pipeline axis (stage ``s`` is its rank ``s``).
        stages: ``p``, the stages; part ``k`` runs on stage ``k % p``.
        parts: ``P``, the model's parts in all.
        module: this rank's parts; received arrays go where its parameters live.

    Attributes:
        wait_seconds: the time spent waiting in :meth:`waited` since it was last reset.
    """

    def __init__(self, comm: Communicator, stages: int, parts: int, module: Module) -> None:
        self.comm, self.p, self.parts, self.module = comm, stages, parts, module
        self.wait_seconds = 0.0
        self._posted: dict[tuple[int, int], list] = {}  # (source, tag) -> posted receives
        self.received = self.early = 0  # receives, and those posted ahead (:meth:`post`)

    def _xp(self) -> Any:
        return get_array_module(next(iter(self.module.parameters())).data)

    def _tag(self, message: Any) -> int:
        return 2 * message.part + (message.kind == "gradient")

    def send(self, array: Any, message: Any) -> Any:
        """Post the send of ``message`` (a schedule's activation or gradient) to the stage
        of the part it goes into; returns the request."""
        xp = get_array_module(array)
        return self.comm.isend(xp.ascontiguousarray(array), message.part % self.p,
                               tag=self._tag(message))

    def _source(self, message: Any) -> int:
        # The part on the other side of the message: k - 1 for an activation into part
        # k, k + 1 for a gradient into it.
        source = message.part - 1 if message.kind == "activation" else message.part + 1
        return source % self.p

    def post(self, shape: tuple, dtype: Any, message: Any) -> None:
        """Post the receive of ``message`` now, ahead of the action that waits for it
        (#48: a receive posted just before its wait leaves MPI nothing to match the
        peer's send into meanwhile). Receives of one source and tag are matched in the
        order they are posted, which is the order the peer sends them."""
        key = (self._source(message), self._tag(message))
        buf = self._xp().empty(shape, dtype=dtype)
        request = self.comm.irecv_(buf, key[0], tag=key[1])
        self._posted.setdefault(key, []).append((tuple(shape), request))

    def receive(self, shape: tuple, dtype: Any, message: Any) -> Any:
        """Receive ``message`` (an array of ``shape`` and ``dtype``) and wait for it:
        the receive :meth:`post` posted for it, else one posted now."""
        key = (self._source(message), self._tag(message))
        posted = self._posted.get(key)
        self.received += 1
        if posted:
            got_shape, request = posted.pop(0)
            if got_shape != tuple(shape):
                raise RuntimeError(f"pipeline: the receive posted for {message} expects "
                                   f"shape {got_shape}, its action {tuple(shape)}")
            self.early += 1
            return self.waited(request)
        buf = self._xp().empty(shape, dtype=dtype)
        return self.waited(self.comm.irecv_(buf, key[0], tag=key[1]))

    def waited(self, request: Any) -> Any:
        """``request.wait()``, its time added to :attr:`wait_seconds` (the bubble)."""
        start = time.perf_counter()
        try:
            return request.wait()
        finally:
            self.wait_seconds += time.perf_counter() - start

    # -- the tied weight ----------------------------------------------------------------------
    def exchange_tied(self, first: Any, last: Any, sends: list) -> Tensor | None:
        """Part 0 (``first``, if this rank holds it) posts the send of its tied weight to
        the last part's stage; the last part (``last``) receives it as a leaf, set as its
        ``tied_weight``, whose gradient accumulates over the step's microbatches.

        Returns the tied weight as this rank's step uses it: the last part's leaf, else
        part 0's Parameter, else None (no tied weight here).
        """
        tag = 2 * self.parts
        if first is not None and first.tied_out is not None:
            sends.append(self.comm.isend(first.tied_out.data, (self.parts - 1) % self.p,
                                         tag=tag))
        if last is not None and last.tied_in is not None:
            shape, dtype = last.tied_in
            w = self.waited(self.comm.irecv_(self._xp().empty(shape, dtype=dtype), 0, tag=tag))
            last.tied_weight = Tensor(w, requires_grad=True)
            # Its gradient sums the step's m microbatches: in float32 for a 16-bit
            # weight (as the wrapper's fp32 buckets sum the parameters' own), and sent
            # so (send_tied_gradient).
            if is_half(dtype):
                last.tied_weight.grad_buffer = self._xp().zeros(shape, compute_dtype(dtype))
            return last.tied_weight
        if first is not None and first.tied_out is not None:
            return first.tied_out
        return None

    def send_tied_gradient(self, grad: Any) -> Any:
        """The last part posts its gradient of the tied weight to part 0's stage."""
        return self.comm.isend(grad, 0, tag=2 * self.parts + 1)

    def receive_tied_gradient(self, weight: Any) -> Any:
        """Part 0 receives the last part's gradient of ``weight`` (the tied Parameter;
        float32 for a 16-bit one, as :meth:`exchange_tied` accumulates it)."""
        xp = get_array_module(weight.data)
        buf = xp.empty(weight.data.shape, dtype=compute_dtype(weight.data.dtype))
        return self.waited(self.comm.irecv_(buf,
                                            (self.parts - 1) % self.p,
                                            tag=2 * self.parts + 1))


__all__ = ["StageMessages"]
