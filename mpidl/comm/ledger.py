"""The ledger of a communicator: its collectives numbered, with call sites and waits.

Every collective of an :class:`~mpidl.comm.mpi.MpiCommunicator` is numbered in call
order (``#1, #2, ...``, the same numbers on every rank of a correct program) and
remembered with the place in the caller's code it came from. What a rank is waiting in
right now is :attr:`Ledger.inflight`. Two users:

- ``MPIDL_CHECK_COLLECTIVES=1`` compares number, name and call site across ranks before
  each collective (:mod:`mpidl.comm.mpi`), so a skipped or extra collective is named at
  the first call where the ranks part, instead of pairing with a later one.
- the watchdog (:mod:`mpidl.comm.watchdog`) reports, for a wait that lasts too long,
  what every rank is in and what it did last.

Cost: numbering and the call site (a walk up a few frames) take about 1-2 us per
collective; a training step makes a handful.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

RECENT = 8  # finished collectives kept per ledger, for reports

_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
_local = threading.local()
_ledgers: "weakref.WeakSet[Ledger]" = weakref.WeakSet()


@dataclass
class Entry:
    """One collective call: its number, name, call site and times."""

    seq: int
    op: str
    site: str
    start: float = 0.0   # time.monotonic() when the rank began to wait, 0 if not yet
    end: float = 0.0     # when the wait ended, 0 while in flight
    patient: str = ""    # why a long wait is expected here ("" = the watchdog's timeout)
    peer: int | None = None  # point-to-point: the other rank, as a COMM_WORLD rank

    def describe(self, now: float | None = None) -> str:
        """``allreduce_ #12 at trainer.py:310 in _record_train (waiting 4.2 s)``; a
        point-to-point call: ``recv_ p2p #3 from world rank 5 at ...``."""
        if self.peer is None:
            text = f"{self.op} #{self.seq} at {self.site}"
        else:
            way = "to" if "send" in self.op else "from"
            text = f"{self.op} p2p #{self.seq} {way} world rank {self.peer} at {self.site}"
        if self.start and not self.end:
            text += f" (waiting {(now or time.monotonic()) - self.start:.1f} s)"
        return text

    def as_dict(self) -> dict:
        return {"seq": self.seq, "op": self.op, "site": self.site, "start": self.start,
                "end": self.end, "patient": self.patient, "peer": self.peer}


def call_site() -> str:
    """``file.py:LINE in FUNCTION`` of the first caller outside :mod:`mpidl.comm`.

    The basename, not the path: ranks may run the same code from different checkouts.
    """
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_COMM_DIR):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = frame.f_code
    return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"


@contextlib.contextmanager
def patience(reason: str) -> Iterator[None]:
    """Collectives begun inside wait as long as they must: the watchdog's timeout does
    not apply to them (a rank that exits while they wait still ends the job).

    For waits on known long work of one rank, e.g. the other ranks waiting while rank
    0 writes a checkpoint or generates a corpus. Not collective; per thread.
    """
    previous = getattr(_local, "patience", "")
    _local.patience = reason
    try:
        yield
    finally:
        _local.patience = previous


class Ledger:
    """The numbered collectives of one communicator, on this rank.

    Args:
        key: the communicator's name, the same on every one of its ranks ("world",
            "comm3").
        world_ranks: its members as ranks of ``COMM_WORLD``.
    """

    def __init__(self, key: str, world_ranks: tuple[int, ...]) -> None:
        self.key = key
        self.world_ranks = world_ranks
        self.seq = 0
        self.p2p_seq = 0  # point-to-point calls, numbered apart: ranks make different ones
        self.inflight: Entry | None = None
        self.recent: collections.deque[Entry] = collections.deque(maxlen=RECENT)
        _ledgers.add(self)

    def begin(self, op: str, peer: int | None = None) -> Entry:
        """Number the next collective, named ``op``, called from the caller's caller.

        ``peer`` (a world rank) marks a point-to-point call: numbered in its own
        sequence, since two ranks of a correct program make different ones (a first
        pipeline stage receives no activations), so the collectives' numbers stay the
        same on every rank.
        """
        patient = getattr(_local, "patience", "")
        if peer is not None:
            self.p2p_seq += 1
            return Entry(self.p2p_seq, op, call_site(), patient=patient, peer=peer)
        self.seq += 1
        return Entry(self.seq, op, call_site(), patient=patient)

    @contextlib.contextmanager
    def waiting(self, entry: Entry) -> Iterator[Entry]:
        """Mark ``entry`` as what this rank waits in, for the duration of the block."""
        outer, self.inflight = self.inflight, entry
        entry.start = time.monotonic()
        try:
            yield entry
        finally:
            entry.end = time.monotonic()
            self.inflight = outer
            self.recent.append(entry)

    @contextlib.contextmanager
    def call(self, op: str) -> Iterator[Entry]:
        """Number a blocking collective and wait in it: ``with ledger.call("fence"):``."""
        with self.waiting(self.begin(op)) as entry:
            yield entry

    def snapshot(self) -> dict:
        """What the ledger holds, as plain data (for another rank's report)."""
        return {"key": self.key, "world_ranks": list(self.world_ranks), "seq": self.seq,
                "inflight": self.inflight.as_dict() if self.inflight else None,
                "recent": [e.as_dict() for e in self.recent]}


def all_ledgers() -> list[Ledger]:
    """The ledgers of this process's live communicators."""
    return list(_ledgers)
