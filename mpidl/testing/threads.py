"""Ranks as threads: a communicator for unit tests of collective code, without mpiexec.

:func:`run_ranks` runs ``fn(comm, *args)`` on ``size`` threads, each with its own
:class:`ThreadCommunicator` of one group, and returns what each rank returned, in rank
order. The communicator keeps the semantics of :class:`~mpidl.comm.mpi.MpiCommunicator`
(in-place buffers written in place, results fresh arrays, float16 reduced by sum only,
``split`` ordered like ``MPI_Comm_split``), so a wrapper's collective order, scaling
and empty-rank behaviour are tested in milliseconds::

    def train(comm, x, y):
        dp = DataParallel(mlp(sizes=(7, 11, 5), seed=4), comm, shared_memory=False)
        start = sum(split_counts(len(x), comm.size)[:comm.rank])
        ...
        return [call.name for call in comm.calls]

    names = run_ranks(3, train, x, y)      # names[r]: rank r's calls

Where MPI would hang or silently pair different calls, this fails loudly on every rank:
each collective first compares its name, shape, dtype, op and root across the ranks
(as ``MPIDL_CHECK_COLLECTIVES=1`` does on MPI); a rank that never arrives is named after
``timeout`` seconds (at once when its function has returned); an exception on one rank
ends the others' waits at once (ChainerMN's ``global_except_hook``), and the caller gets
the exception of the lowest rank that raised first-hand, with its rank noted.

Non-blocking calls: a collective started with ``iallreduce_``/``iallgather`` hands over
its part at start and completes at ``wait()`` (or a ``test()`` that finds every rank's
part), so, as MPI requires, every rank must start its collectives in the same order,
blocking and non-blocking together; a rank that starts them in another order gets the
mismatch error. ``isendrecv`` deposits its message in a per-(source, dest) FIFO when it
starts and receives at ``wait()``: every order MPI's eager sends allow works. So do
``isend`` (deposited at start) and ``irecv_`` (at ``wait()``), per tag.

What it does not model:

- MPI's progress and timing: no message is ever "in flight", sums fold in rank order
  (a float sum may differ from MPI's in the last bits, as two MPI libraries do), and
  a deadlock that only a rendezvous protocol would show may pass here.
- Shared memory between processes: there is no ``node_comm``, so data parallelism never
  chooses its MPI shared-memory window, and a hierarchical transport needs an explicit
  ``ranks_per_node``. No device (CuPy) staging either.
- Process isolation: every rank shares the process's global state: NumPy's global RNG
  (draw from a per-rank ``numpy.random.default_rng``), module-level caches, the
  environment, and ``mpidl.comm.world()`` (a world of one: pass ``comm`` explicitly).
  Process-wide tools see every rank at once: ``tracemalloc`` (so
  :func:`mpidl.testing.memory.peak_bytes` measures all ranks, and starting and stopping
  it on several ranks together crashed CPython 3.11), and signal handlers (only the
  main thread may install them: ``PreemptionFlag`` refuses a rank's thread).
  Grad mode of :mod:`mpidl.autograd` is thread-local (``no_grad`` on one rank does not
  reach another), so forward and backward in the ranks' threads are safe.
"""
from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy

from mpidl.backend import get_array_module
from mpidl.comm import base
from mpidl.comm.base import (Communicator, DistributedError, Request, check_op,
                             check_reducible, split_counts)


@dataclass(frozen=True)
class Call:
    """One call on a :class:`ThreadCommunicator`, as recorded in ``comm.calls``.

    Attributes:
        seq: the call's number on this rank's communicator, from 1 (``calls[seq - 1]``).
        name: the method: "allreduce_", "barrier", "bcast_obj", "isendrecv", ...
        shape, dtype: of the array handed over; None for barrier, ``*_obj``, split, free.
        op: the reduction ("sum", "max", "min", "prod", "float16 wire sum", ...).
        root: of bcast_, reduce_ and bcast_obj.
        nbytes: bytes of the array handed over (what CountingCommunicator counts; 0
            for barrier, ``*_obj``, split and free).
        point_to_point: True for sendrecv and isendrecv, which ranks do not compare.
        dest, source: the peers of a point-to-point call.
        site: ``file.py:LINE in function`` of the caller (left out of ``==``).
    """

    seq: int
    name: str
    shape: tuple | None = None
    dtype: str | None = None
    op: str | None = None
    root: int | None = None
    nbytes: int = 0
    point_to_point: bool = False
    dest: int | None = None
    source: int | None = None
    site: str = field(default="", compare=False)

    def signature(self) -> tuple:
        """What every rank's call must match (allgatherv's row counts may differ)."""
        shape = self.shape
        if self.name == "allgatherv" and shape:
            shape = ("rows",) + shape[1:]
        return (self.name, shape, self.dtype, self.op, self.root)

    def describe(self) -> str:
        """``#4 allreduce_(shape (3,), float64, op=sum)``."""
        args = [] if self.shape is None else [f"shape {self.shape}, {self.dtype}"]
        args += [f"{k}={v}" for k, v in (("op", self.op), ("root", self.root),
                                          ("dest", self.dest), ("source", self.source))
                 if v is not None]
        return f"#{self.seq} {self.name}({', '.join(args)})"


class _Aborted(DistributedError):
    """Raised in a rank's wait because another rank's function raised: a consequence,
    never the error :func:`run_ranks` reports."""


class _World:
    """What every group of one :func:`run_ranks` call shares, behind one condition."""

    def __init__(self, size: int, ranks_per_node: int | None, timeout: float) -> None:
        self.size, self.ranks_per_node, self.timeout = size, ranks_per_node, timeout
        self.cond = threading.Condition()
        self.errors: dict[int, BaseException] = {}  # world rank -> what its fn raised
        self.ended: set[int] = set()  # world ranks whose fn has returned or raised
        self.splits: dict[tuple, list] = {}  # (group, round, color) -> [group, takers left]

    def node(self, world_rank: int) -> int:
        return 0 if self.ranks_per_node is None else world_rank // self.ranks_per_node

    def failed(self) -> dict[int, BaseException]:
        """The ranks whose fn raised an error of its own (not an abort)."""
        return {r: e for r, e in self.errors.items() if not isinstance(e, _Aborted)}


class _Round:
    """One collective of a group: each rank's call and its part (read-only once put)."""

    def __init__(self, size: int) -> None:
        self.calls: list[Call | None] = [None] * size
        self.parts: list[Any] = [None] * size
        self.arrived = 0
        self.unread = size


class _Group:
    """The state the ranks of one communicator share: collectives and mailboxes."""

    def __init__(self, world: _World, members: tuple[int, ...], label: str) -> None:
        self.world, self.members, self.label = world, members, label
        self.size = len(members)
        self.rounds: dict[int, _Round] = {}
        # (source, dest, tag, number) -> (array, sender's call site); tag None: sendrecv
        self.mail: dict[tuple, Any] = {}
        self.broken = ""  # set by a timeout: later collectives fail at once

    def name(self, ranks: Sequence[int]) -> str:
        """``ranks 1, 2``, with their world ranks in a split group."""
        text = _ranks(ranks)
        if self.members != tuple(range(self.size)):
            text += f" (world {', '.join(str(self.members[r]) for r in ranks)})"
        return text


class ThreadCommunicator(Communicator):
    """One rank's handle on a group of thread ranks; made by :func:`run_ranks` and split.

    Keeps the contract of :class:`~mpidl.comm.base.Communicator` and the semantics of
    :class:`~mpidl.comm.mpi.MpiCommunicator`; every call is appended to :attr:`calls`.

    Attributes:
        calls: this rank's calls on this communicator, in order (:class:`Call`).
        local_rank, local_size: among the group's ranks on this rank's "node" (with
            ``run_ranks(ranks_per_node=k)``, world ranks ``k*i .. k*i + k - 1``).
    """

    def __init__(self, group: _Group, rank: int) -> None:
        self._group = group
        self.rank, self.size = rank, group.size
        world = group.world
        node = world.node(group.members[rank])
        same_node = [r for r in range(group.size) if world.node(group.members[r]) == node]
        self.local_rank, self.local_size = same_node.index(rank), len(same_node)
        self.calls: list[Call] = []
        self._rounds = 0  # collectives started here (the group's round numbers)
        self._sent: dict[tuple, int] = {}  # (dest, tag) -> messages sent to it
        self._received: dict[tuple, int] = {}  # (source, tag) -> receives started from it
        self._freed = False

    def __repr__(self) -> str:
        return f"ThreadCommunicator(rank={self.rank}, size={self.size}, {self._group.label})"

    # -- reductions -------------------------------------------------------------------
    def allreduce_(self, x: Any, op: Any = "sum") -> Any:
        """Reduce ``x`` elementwise over all ranks, in place; returns ``x``.

        Collective: every rank passes a C-contiguous array of the same shape and dtype
        and the same ``op`` ("sum", "max", "min", "prod", or one of mpidl's 16-bit wire
        sums, :func:`mpidl.parallel.compression.wire_sum_op`).
        """
        label, fold = self._reducer(x, op, "allreduce_")
        parts = self._collective(self._record("allreduce_", x, op=label), x.copy())
        x[...] = fold(parts)
        return x

    def iallreduce_(self, x: Any, op: Any = "sum") -> Request:
        """Start :meth:`allreduce_`; ``x`` holds the result after ``wait()``.

        Collective as allreduce_; ``x`` is read at the start (it may not be written
        until ``wait()``, as on MPI). Start order must match across ranks.
        """
        label, fold = self._reducer(x, op, "iallreduce_")
        call = self._record("iallreduce_", x, op=label)
        n = self._start(call, x.copy())

        def complete(block: bool) -> Any:
            parts = self._finish(n, call, block)
            if parts is None:
                return _PENDING
            x[...] = fold(parts)
            return x

        return _ThreadRequest(complete)

    def reduce_(self, x: Any, root: int = 0, op: Any = "sum") -> Any:
        """Reduce ``x`` over all ranks into root's ``x``, in place; returns ``x``.

        Collective: same shape, dtype, ``root`` and ``op`` everywhere. The other ranks'
        ``x`` are left as they were.
        """
        self._check_peer(root, "root")
        label, fold = self._reducer(x, op, "reduce_")
        parts = self._collective(self._record("reduce_", x, op=label, root=root), x.copy())
        if self.rank == root:
            x[...] = fold(parts)
        return x

    def reduce_scatter(self, x: Any, op: Any = "sum") -> Any:
        """Reduce ``x`` over all ranks and return this rank's block (a new array).

        ``x`` splits along axis 0 by :func:`~mpidl.comm.base.split_counts`; rank r
        receives block r. Collective: same shape, dtype and ``op`` on every rank.
        """
        _need_rows(x, "reduce_scatter")
        label, fold = self._reducer(x, op, "reduce_scatter", contiguous=False)
        parts = self._collective(self._record("reduce_scatter", x, op=label), x.copy())
        rows = split_counts(x.shape[0], self.size)
        start = sum(rows[:self.rank])
        return fold([p[start:start + rows[self.rank]] for p in parts])

    # -- data movement ----------------------------------------------------------------
    def bcast_(self, x: Any, root: int = 0) -> Any:
        """Overwrite every rank's ``x`` with root's, in place; returns ``x``.

        Collective: same shape and dtype everywhere, same ``root``.
        """
        self._check_peer(root, "root")
        _contiguous(x, "bcast_")
        mine = x.copy() if self.rank == root else None
        parts = self._collective(self._record("bcast_", x, root=root), mine)
        if self.rank != root:
            x[...] = parts[root]
        return x

    def allgather(self, x: Any) -> Any:
        """Every rank's ``x`` stacked: shape ``(size, *x.shape)``, row r from rank r.

        Collective: same shape and dtype on every rank.
        """
        parts = self._collective(self._record("allgather", x), x.copy())
        return get_array_module(x).stack(parts)

    def iallgather(self, x: Any) -> Request:
        """Start :meth:`allgather`; ``wait()`` returns the ``(size, *shape)`` result.

        Collective as allgather; ``x`` is read at the start. Start order must match.
        """
        call = self._record("iallgather", x)
        n = self._start(call, x.copy())
        xp = get_array_module(x)

        def complete(block: bool) -> Any:
            parts = self._finish(n, call, block)
            return _PENDING if parts is None else xp.stack(parts)

        return _ThreadRequest(complete)

    def allgatherv(self, x: Any) -> Any:
        """Every rank's ``x`` concatenated along axis 0, in rank order.

        Collective: ``x.shape[1:]`` and dtype must match on every rank; ``x.shape[0]``
        may differ (zero included).
        """
        _need_rows(x, "allgatherv")
        parts = self._collective(self._record("allgatherv", x), x.copy())
        return get_array_module(x).concatenate(parts, axis=0)

    def alltoall(self, x: Any) -> Any:
        """Block ``x[j]`` goes to rank j; returns ``y`` with ``y[i]`` = rank i's ``x[rank]``.

        Collective: ``x.shape[0] == size`` and the same shape and dtype on every rank.
        """
        if x.shape[:1] != (self.size,):
            raise ValueError(f"alltoall needs x.shape[0] == size == {self.size}, "
                             f"got shape {x.shape}")
        parts = self._collective(self._record("alltoall", x), x.copy())
        return get_array_module(x).stack([p[self.rank] for p in parts])

    def barrier(self) -> None:
        """Wait until every rank has called barrier. Collective."""
        self._collective(self._record("barrier"), None)

    def allgather_obj(self, obj: Any) -> list:
        """The list of every rank's ``obj``, pickled as mpi4py does (small metadata).

        Collective; the objects may differ between ranks. An object MPI cannot pickle
        fails here too.
        """
        mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        parts = self._collective(self._record("allgather_obj"), mine)
        return [pickle.loads(p) for p in parts]

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Root's ``obj`` on every rank, root included (a pickled copy).

        Collective; non-root ranks may pass anything (None).
        """
        self._check_peer(root, "root")
        mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else None
        parts = self._collective(self._record("bcast_obj", root=root), mine)
        return pickle.loads(parts[root])

    # -- point to point ---------------------------------------------------------------
    def sendrecv(self, x: Any, dest: int, source: int) -> Any:
        """Send ``x`` to ``dest``; return the array received from ``source`` (new).

        Point-to-point in pairs: ``source`` must send this rank an array of the same
        shape and dtype.
        """
        return self._exchange("sendrecv", x, dest, source).wait()

    def isendrecv(self, x: Any, dest: int, source: int) -> Request:
        """Start sending ``x`` to ``dest`` and receiving from ``source``; ``wait()``
        returns the received array.

        Point-to-point: the message is deposited now and received at ``wait()``;
        several exchanges between the same ranks match in the order they were started
        (MPI's non-overtaking rule).
        """
        return self._exchange("isendrecv", x, dest, source)

    def isend(self, x: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``x`` to ``dest`` with ``tag``: deposited (a copy) now, as an
        eager MPI send; ``wait()`` returns None. Point-to-point (see
        :meth:`~mpidl.comm.base.Communicator.isend`)."""
        return self._exchange("isend", x, dest, None, base.check_tag(tag))

    def irecv_(self, x: Any, source: int, tag: int = 0) -> Request:
        """Start receiving ``source``'s message with ``tag`` into ``x``; ``wait()``
        returns ``x``. Another shape or dtype than the sender's is a DistributedError
        naming both ranks and both call sites; a sender that never sends is named after
        ``timeout`` (at once when its function has returned)."""
        _contiguous(x, "irecv_")
        return self._exchange("irecv_", None, None, source, base.check_tag(tag), into=x)

    # -- groups -----------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> "ThreadCommunicator":
        """Ranks passing the same ``color`` form a new communicator.

        Collective over this group. New ranks are ordered by ``key`` (default: the rank
        here), ties by the rank here, as ``MPI_Comm_split`` orders them.
        """
        if isinstance(color, bool) or not isinstance(color, (int, numpy.integer)) or color < 0:
            raise ValueError(f"split(color={color!r}): color must be an int >= 0 "
                             "(MPI_UNDEFINED is not supported: give every rank a group)")
        call = self._record("split")
        n = self._start(call, (int(color), self.rank if key is None else int(key)))
        parts = self._finish(n, call)
        members = sorted((r for r in range(self.size) if parts[r][0] == color),
                         key=lambda r: (parts[r][1], r))
        g, world = self._group, self._group.world
        ident = (id(g), n, int(color))
        with world.cond:
            entry = world.splits.get(ident)
            if entry is None:
                label = f"{g.label}/split #{call.seq} color {color}"
                entry = world.splits[ident] = [
                    _Group(world, tuple(g.members[r] for r in members), label), len(members)]
            entry[1] -= 1
            if entry[1] == 0:
                del world.splits[ident]
        return ThreadCommunicator(entry[0], members.index(self.rank))

    def free(self) -> None:
        """Retire this communicator; any later call on it raises. Collective (a second
        ``free`` does nothing, as on MpiCommunicator)."""
        if not self._freed:
            self._collective(self._record("free"), None)
            self._freed = True

    # -- machinery --------------------------------------------------------------------
    def _record(self, name: str, x: Any = None, op: str | None = None,
                root: int | None = None, dest: int | None = None,
                source: int | None = None) -> Call:
        if self._freed:
            raise ValueError(f"{name} on a freed communicator ({self!r}): free() was called "
                             "on it; use the communicator it was split from, or split again")
        call = Call(seq=len(self.calls) + 1, name=name,
                    shape=None if x is None else tuple(x.shape),
                    dtype=None if x is None else str(x.dtype), op=op, root=root,
                    nbytes=0 if x is None else int(x.nbytes),
                    point_to_point=dest is not None or source is not None,
                    dest=dest, source=source, site=_call_site())
        self.calls.append(call)
        return call

    def _reducer(self, x: Any, op: Any, what: str,
                 contiguous: bool = True) -> tuple[str, Callable[[list], Any]]:
        """The checks MPI makes first, then the op's name and its rank-order fold."""
        if contiguous:
            _contiguous(x, what)
        check_reducible(x, what, op)
        if isinstance(op, str):
            return check_op(op), _FOLDS[check_op(op)]
        return _wire_sum(x, op, what)

    def _collective(self, call: Call, part: Any) -> list:
        return self._finish(self._start(call, part), call)

    def _start(self, call: Call, part: Any) -> int:
        """Put this rank's call and part into its next round; returns the round."""
        g, world = self._group, self._group.world
        with world.cond:
            self._give_up_if_failed(call)
            n, self._rounds = self._rounds, self._rounds + 1
            rnd = g.rounds.get(n)
            if rnd is None:
                rnd = g.rounds[n] = _Round(g.size)
            rnd.calls[self.rank], rnd.parts[self.rank] = call, part
            rnd.arrived += 1
            if rnd.arrived == g.size:
                world.cond.notify_all()
        return n

    def _finish(self, n: int, call: Call, block: bool = True) -> list | None:
        """Every rank's part of round ``n`` once all arrived (None if not yet and not
        ``block``); DistributedError on every rank if their calls differ."""
        g, world = self._group, self._group.world
        with world.cond:
            rnd = g.rounds[n]
            if rnd.arrived < g.size:
                if not block:
                    return None
                self._wait(lambda: rnd.arrived == g.size, call,
                           lambda: [r for r, c in enumerate(rnd.calls) if c is None],
                           f"collective #{n + 1} of {g.label!r}")
            rnd.unread -= 1
            if rnd.unread == 0:
                del g.rounds[n]
        signatures = [c.signature() for c in rnd.calls]
        if any(s != signatures[0] for s in signatures):
            lines = [f"rank {r}: {c.describe()} at {c.site}" for r, c in enumerate(rnd.calls)]
            raise DistributedError(
                f"collective mismatch in collective #{n + 1} of {g.label!r}: "
                + "; ".join(lines) + ". Every rank must make the same collective calls in "
                "the same order, with the same shapes, dtypes, op and root",
                [r for r, s in enumerate(signatures) if s != signatures[0]],
                group_size=g.size)
        return rnd.parts

    def _exchange(self, name: str, x: Any, dest: int | None, source: int | None,
                  tag: int | None = None, into: Any = None) -> Request:
        """Send ``x`` to ``dest`` (deposited now) and/or receive from ``source`` (at
        ``wait()``; into ``into`` when given). Messages match per (source, dest,
        channel) in order: ``tag`` None is sendrecv's channel, a tag its own."""
        if dest is not None:
            self._check_peer(dest, "dest")
        if source is not None:
            self._check_peer(source, "source")
        like = x if x is not None else into
        call = self._record(name, like, dest=dest, source=source)
        g, world = self._group, self._group.world
        if dest is not None:
            sent = self._sent.get((dest, tag), 0)
            self._sent[(dest, tag)] = sent + 1
            with world.cond:
                self._give_up_if_failed(call)
                g.mail[(self.rank, dest, tag, sent)] = (x.copy(), call.site)
                world.cond.notify_all()
        if source is None:
            return _ThreadRequest(lambda block: None)
        number = self._received.get((source, tag), 0)
        self._received[(source, tag)] = number + 1
        box = (source, self.rank, tag, number)
        channel = "" if tag is None else f" with tag {tag}"

        def complete(block: bool) -> Any:
            with world.cond:
                if box not in g.mail:
                    if not block:
                        return _PENDING
                    self._wait(lambda: box in g.mail, call, lambda: [source],
                               f"message #{number + 1}{channel} from rank {source} to "
                               f"rank {self.rank}", collective=False)
                got, site = g.mail.pop(box)
            if got.shape != like.shape or got.dtype != like.dtype:
                raise DistributedError(
                    f"{name} on rank {self.rank}: rank {source} sent shape {got.shape} "
                    f"{got.dtype} (at {site}), this rank receives shape {like.shape} "
                    f"{like.dtype} (at {call.site}); point-to-point partners must exchange "
                    "arrays of one shape and dtype", [source])
            if into is None:
                return got
            into[...] = got
            return into

        return _ThreadRequest(complete)

    def _wait(self, ready: Callable[[], bool], call: Call, missing: Callable[[], list],
              what: str, collective: bool = True) -> None:
        """Wait (holding the world's condition) until ``ready()``; raise DistributedError
        when a rank failed, a missing rank returned, or ``timeout`` passed."""
        g, world = self._group, self._group.world
        deadline = time.monotonic() + world.timeout
        while not ready():
            absent = missing()
            gone = [r for r in absent if g.members[r] in world.ended
                    and g.members[r] not in world.errors]
            waiting = f"rank {self.rank} waits in {call.describe()} ({what})"
            if gone:  # first-hand, so it goes before another rank's failure
                raise DistributedError(
                    f"{waiting}, but {g.name(gone)} returned from its function without "
                    + ("calling it: every rank must make the same collective calls"
                       if collective else "sending it: a receive needs its matching send"),
                    gone)
            self._give_up_if_failed(call)
            left = deadline - time.monotonic()
            if left <= 0:
                message = (f"{waiting}: {g.name(absent)} "
                           f"{'never arrived' if collective else 'did not send it'} within "
                           f"{world.timeout:g} s (a skipped call, or a rank stuck elsewhere)")
                if collective:  # the round can never be matched up again
                    g.broken = message
                    world.cond.notify_all()
                raise DistributedError(message, absent)
            world.cond.wait(left)

    def _give_up_if_failed(self, call: Call) -> None:
        """Raise if another rank's function raised, or a timeout broke this group."""
        g, world = self._group, self._group.world
        failed = world.failed()
        if failed:
            r = min(failed)
            raise _Aborted(f"rank {self.rank} gave up in {call.describe()}: world rank {r} "
                           f"raised {type(failed[r]).__name__}: {failed[r]}",
                           sorted(failed))
        if g.broken:
            raise DistributedError(f"rank {self.rank}: {call.describe()} on a communicator "
                                   f"that a timeout broke: {g.broken}")

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"{what}={peer} is not a rank of a size-{self.size} communicator")


_PENDING = object()  # what a request's completion returns while it cannot complete yet


class _ThreadRequest(Request):
    """A non-blocking call: ``complete(block)`` returns its result or ``_PENDING``."""

    def __init__(self, complete: Callable[[bool], Any]) -> None:
        self._complete, self._result, self._done = complete, None, False

    def test(self) -> bool:
        if not self._done:
            result = self._complete(False)
            if result is not _PENDING:
                self._result, self._done = result, True
        return self._done

    def wait(self) -> Any:
        if not self._done:
            self._result, self._done = self._complete(True), True
        return self._result


def _fold(combine: Callable[[Any, Any], None]) -> Callable[[list], Any]:
    """A reduction over the ranks' parts in rank order, into a fresh array."""

    def fold(parts: list) -> Any:
        acc = parts[0].copy()
        # inf - inf and overflow are the IEEE results MPI's own sum gives, silently.
        with numpy.errstate(over="ignore", invalid="ignore"):
            for p in parts[1:]:
                combine(acc, p)
        return acc

    return fold


def _ufunc(name: str) -> Callable[[Any, Any], None]:
    def combine(acc: Any, p: Any) -> None:
        getattr(get_array_module(acc), name)(acc, p, out=acc)

    return combine


_FOLDS = {"sum": _fold(_ufunc("add")), "max": _fold(_ufunc("maximum")),
          "min": _fold(_ufunc("minimum")), "prod": _fold(_ufunc("multiply"))}


def _add_float16_bits(acc: Any, p: Any) -> None:
    xp = get_array_module(acc)
    halves = acc.view(xp.float16)  # a view: the sum lands in acc
    xp.add(halves, p.view(xp.float16), out=halves)


def _add_bfloat16_bits(acc: Any, p: Any) -> None:
    from mpidl.parallel.compression import bfloat16_to_float32, float32_to_bfloat16

    xp = get_array_module(acc)
    bits = acc.view(xp.uint16)  # a view: the rounded sum lands in acc
    total = bfloat16_to_float32(bits) + bfloat16_to_float32(p.view(xp.uint16))
    float32_to_bfloat16(total, out=bits)


def _wire_sum(x: Any, op: Any, what: str) -> tuple[str, Callable[[list], Any]]:
    """The fold of one of mpidl's user-defined MPI ops, found by identity.

    The ops exist only once mpi4py made them (or a test stood in for them), so asking
    :func:`~mpidl.parallel.compression.wire_sum_op` for the same op returns that very
    object without importing MPI anew.
    """
    from mpidl.parallel import compression

    for wire_dtype, combine in (("float16", _add_float16_bits),
                                ("bfloat16", _add_bfloat16_bits)):
        try:
            known = compression.wire_sum_op(wire_dtype)
        except ImportError:  # no mpi4py: this op cannot be one of them
            continue
        if op is known:
            if x.dtype.itemsize != 2:
                raise TypeError(f"{what} with the {wire_dtype} wire sum of a {x.dtype} "
                                "array: the op sums 16-bit buffers; pass the wire buffer "
                                "(mpidl.parallel.compression.compress)")
            return f"{wire_dtype} wire sum", _fold(combine)
    raise TypeError(f"{what} with op={op!r}: ThreadCommunicator knows the named ops "
                    f"{', '.join(base.OPS)} and mpidl's 16-bit wire sums "
                    "(mpidl.parallel.compression.wire_sum_op) only")


def _contiguous(x: Any, what: str) -> None:
    if not x.flags.c_contiguous:
        raise ValueError(f"{what} needs a C-contiguous array (got shape {x.shape}, strides "
                         f"{x.strides}); pass xp.ascontiguousarray(x)")


def _need_rows(x: Any, what: str) -> None:
    if x.ndim == 0:
        raise ValueError(f"{what} splits or joins along axis 0: got a 0-d array; "
                         "pass x.reshape(1)")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


_HERE = os.path.abspath(__file__)
_COMM_DIR = os.path.dirname(os.path.abspath(base.__file__))


def _call_site() -> str:
    """``file.py:LINE in function`` of the first caller outside this module and
    :mod:`mpidl.comm` (whose ``check`` and ``agree`` call the collectives)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == _HERE
                                 or frame.f_code.co_filename.startswith(_COMM_DIR)):
        frame = frame.f_back
    if frame is None:
        return "?"
    return (f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} "
            f"in {frame.f_code.co_name}")


def run_ranks(size: int, fn: Callable[..., Any], *args: Any, timeout: float = 20.0,
              ranks_per_node: int | None = None, return_exceptions: bool = False,
              **kwargs: Any) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``size`` thread ranks; their results in order.

    Each rank gets its own :class:`ThreadCommunicator` of one group of ``size`` ranks.

    Args:
        size: the number of ranks (threads), >= 1.
        fn: called once per rank with that rank's communicator first.
        timeout: seconds a rank waits in a call for the others before it raises
            DistributedError naming the ranks that never arrived; also how long, after a
            rank failed, the others are given to return.
        ranks_per_node: consecutive blocks of this many ranks form a "node" (what
            ``local_rank`` and ``local_size`` say); None: all ranks on one node.
        return_exceptions: return each failed rank's exception in place of its result
            instead of raising.

    Raises:
        BaseException: what the function of the lowest rank that failed first-hand
            raised (not the "another rank failed" errors of the others), with a note
            (Python 3.10: a cause) naming the rank.
    """
    if isinstance(size, bool) or int(size) != size or size < 1:
        raise ValueError(f"run_ranks(size={size!r}): need a whole number of ranks, >= 1")
    size = int(size)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 (or None: one node)")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds")
    world = _World(size, ranks_per_node, timeout)
    group = _Group(world, tuple(range(size)), "world")
    comms = [ThreadCommunicator(group, r) for r in range(size)]
    results: list[Any] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(comms[rank], *args, **kwargs)
        except BaseException as e:  # pytest.fail and skip too: the caller re-raises them
            with world.cond:
                world.errors[rank] = e
        finally:
            with world.cond:
                world.ended.add(rank)
                world.cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,), name=f"mpidl-rank-{r}", daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    with world.cond:
        deadline = None
        while len(world.ended) < size:
            if world.errors and deadline is None:
                deadline = time.monotonic() + timeout
            if deadline is not None and time.monotonic() >= deadline:
                break  # the rest are stuck outside any call (daemon threads: left behind)
            world.cond.wait(1.0 if deadline is None else
                            max(0.0, min(1.0, deadline - time.monotonic())))
        errors, failed = dict(world.errors), world.failed()
        stuck = sorted(set(range(size)) - world.ended)
    for r in stuck:
        errors[r] = DistributedError(f"{_ranks(stuck)} did not return within {timeout:g} s "
                                     "after a rank failed", stuck)
    if return_exceptions:
        return [errors.get(r, results[r]) for r in range(size)]
    if errors:
        r = min(failed or errors)  # an abort only where no rank has an error of its own
        e = errors[r]
        note = f"raised on rank {r} of {size} (mpidl.testing.run_ranks)"
        if stuck:
            note += f"; {_ranks(stuck)} never returned"
        if hasattr(e, "add_note"):
            e.add_note(note)
        elif e.__cause__ is None:  # Python 3.10: no notes; the chain names the rank
            e.__cause__ = DistributedError(note, [r])
        raise e
    return results


__all__ = ["Call", "ThreadCommunicator", "run_ranks"]
