"""Where thread ranks meet: a group's rounds of collectives, its mailboxes, the check
that every rank made the same call, and the waits that end in an error, not a hang.

:class:`Rendezvous` is the part of :class:`~mpidl.testing.ThreadCommunicator` that
every call goes through: :meth:`~Rendezvous._record` appends the call to ``calls``
(:class:`Call`, with its caller's file and line); a collective puts the rank's part into
the group's next round (:meth:`~Rendezvous._start`) and takes every rank's parts once
all arrived (:meth:`~Rendezvous._finish`), after comparing the ranks' calls; a
point-to-point message is deposited in the group's mailbox and taken at ``wait()``
(:meth:`~Rendezvous._exchange`). A wait ends with a DistributedError naming the ranks
when one of them returned without the call, raised, or never came within the timeout.
What the calls compute (reductions, copies) is :mod:`mpidl.testing.threads`'s.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mpidl.comm import base
from mpidl.comm.base import DistributedError, Request


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


class Aborted(DistributedError):
    """Raised in a rank's wait because another rank's function raised: a consequence,
    never the error :func:`run_ranks` reports."""


class World:
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
        return {r: e for r, e in self.errors.items() if not isinstance(e, Aborted)}


class Round:
    """One collective of a group: each rank's call and its part (read-only once put)."""

    def __init__(self, size: int) -> None:
        self.calls: list[Call | None] = [None] * size
        self.parts: list[Any] = [None] * size
        self.arrived = 0
        self.unread = size


class Group:
    """The state the ranks of one communicator share: collectives and mailboxes."""

    def __init__(self, world: World, members: tuple[int, ...], label: str) -> None:
        self.world, self.members, self.label = world, members, label
        self.size = len(members)
        self.rounds: dict[int, Round] = {}
        # (source, dest, tag, number) -> (array, sender's call site); tag None: sendrecv
        self.mail: dict[tuple, Any] = {}
        self.broken = ""  # set by a timeout: later collectives fail at once

    def name(self, ranks: Sequence[int]) -> str:
        """``ranks 1, 2``, with their world ranks in a split group."""
        text = rank_list(ranks)
        if self.members != tuple(range(self.size)):
            text += f" (world {', '.join(str(self.members[r]) for r in ranks)})"
        return text


class Rendezvous:
    """A rank's endpoint in a group: its calls, its round and message counters.

    Attributes:
        calls: this rank's calls on this communicator, in order (:class:`Call`).
        local_rank, local_size: among the group's ranks on this rank's "node".
    """

    def __init__(self, group: Group, rank: int) -> None:
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
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, {self._group.label})"

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
                rnd = g.rounds[n] = Round(g.size)
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
            return ThreadRequest(lambda block: None)
        number = self._received.get((source, tag), 0)
        self._received[(source, tag)] = number + 1
        box = (source, self.rank, tag, number)
        channel = "" if tag is None else f" with tag {tag}"

        def complete(block: bool) -> Any:
            with world.cond:
                if box not in g.mail:
                    if not block:
                        return PENDING
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

        return ThreadRequest(complete)

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
            raise Aborted(f"rank {self.rank} gave up in {call.describe()}: world rank {r} "
                           f"raised {type(failed[r]).__name__}: {failed[r]}",
                           sorted(failed))
        if g.broken:
            raise DistributedError(f"rank {self.rank}: {call.describe()} on a communicator "
                                   f"that a timeout broke: {g.broken}")

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size:
            raise ValueError(f"{what}={peer} is not a rank of a size-{self.size} communicator")


PENDING = object()  # what a request's completion returns while it cannot complete yet


class ThreadRequest(Request):
    """A non-blocking call: ``complete(block)`` returns its result or ``PENDING``."""

    def __init__(self, complete: Callable[[bool], Any]) -> None:
        self._complete, self._result, self._done = complete, None, False

    def test(self) -> bool:
        if not self._done:
            result = self._complete(False)
            if result is not PENDING:
                self._result, self._done = result, True
        return self._done

    def wait(self) -> Any:
        if not self._done:
            self._result, self._done = self._complete(True), True
        return self._result


def rank_list(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# The frames a call site skips: thread ranks' own modules.
_OWN = {os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
        for name in ("threads.py", "rendezvous.py")}
_COMM_DIR = os.path.dirname(os.path.abspath(base.__file__))


def _call_site() -> str:
    """``file.py:LINE in function`` of the first caller outside thread ranks' modules
    and :mod:`mpidl.comm` (whose ``check`` and ``agree`` call the collectives)."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename in _OWN
                                 or frame.f_code.co_filename.startswith(_COMM_DIR)):
        frame = frame.f_back
    if frame is None:
        return "?"
    return (f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} "
            f"in {frame.f_code.co_name}")


__all__ = ["Call", "Rendezvous", "World", "Group", "Round", "ThreadRequest", "PENDING",
           "Aborted", "rank_list"]
