"""The watchdog: a hung collective, or a rank gone while others wait, ends the job.

Without it, a rank that skips a collective, waits in another one, stops (SIGSTOP, a
debugger) or exits leaves the others blocked in MPI for as long as the allocation
lasts: MPI has no timeout. The watchdog is a thread on every rank, over its own
duplicate of ``COMM_WORLD`` (its messages never match the job's), that looks at what
the rank waits in (the communicators' :mod:`~mpidl.comm.ledger`):

- **A wait longer than the timeout** (``MPIDL_TIMEOUT`` seconds, the trainer's
  ``timeout`` key, default :data:`DEFAULT_TIMEOUT`): the rank alerts rank 0, whose
  watchdog asks every rank what it is in. Each rank that answers prints its last
  collectives and the Python stack of every thread (faulthandler); rank 0 prints which
  ranks are in the collective, which never arrived and where they are instead, and
  which did not answer (stopped, dead, or holding the GIL), then aborts the job
  (``MPI_Abort``, status :data:`EXIT_HUNG`). If rank 0 cannot (it is the stopped one),
  the alerting rank does it itself.
- **A rank that exits** (end of the program, ``sys.exit`` of any code, ``SystemExit``)
  first tells every other rank. A rank that waits in a collective the exited rank
  belongs to, and still waits a few seconds later, ends the job the same way; a rank
  exiting normally waits for the others at exit, as MPI_Finalize would.

Waits on known long work of one rank (others waiting while rank 0 writes a checkpoint)
are marked with :func:`mpidl.comm.ledger.patience` and get :data:`PATIENCE` times the
timeout: a node lost while the others wait there (its link cut while the ranks write a
checkpoint) would otherwise hold them for ever, as it did (issue 32).

The watchdog runs only where the job asks for it: every ``mpidl`` command enables it
(:func:`enable`, before the world communicator is made), and ``MPIDL_TIMEOUT=SECONDS``
enables it for any program using :func:`mpidl.comm.world`; ``MPIDL_TIMEOUT=0`` turns
it off. It needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default); otherwise it says so once
and stays off. Its cost: one wake-up every :data:`POLL` seconds (a non-blocking probe).
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import tempfile
import threading
import time
from typing import Any

from mpidl.comm.ledger import all_ledgers

DEFAULT_TIMEOUT = 600.0  # seconds; PyTorch's NCCL watchdog default is 10 minutes too
POLL = 0.25              # seconds between the thread's looks
ANSWER = 5.0             # seconds a reporter waits for the other ranks' answers
EXIT_GRACE = 5.0         # seconds a wait may outlast the exit of a rank it needs
PATIENCE = 10            # timeouts a patient wait may last (ledger.patience): 100 min at
                         # the default, for a checkpoint or a corpus written by one rank
# The job's exit status after the watchdog aborts it: 124, as timeout(1) ends a command
# that ran past its limit, so that a batch script can tell a hang from a divergence or
# a traceback (both 1). Open MPI's mpiexec exits with the MPI_Abort code (measured).
EXIT_HUNG = 124

_TAG_EXIT, _TAG_ASK, _TAG_STATE, _TAG_ALERT = 71, 72, 73, 74

_wanted = False
_current: "Watchdog | None" = None


def enable() -> None:
    """Ask for the watchdog in this process (the job's choice: every ``mpidl`` command
    makes it). It starts with the world communicator; not collective by itself."""
    global _wanted
    _wanted = True


def timeout_from_env(environ: Any = os.environ) -> float | None:
    """``MPIDL_TIMEOUT`` as seconds: None if unset, 0.0 for off ("0", "off", "none").

    Raises:
        ValueError: not a number >= 0 (the message names the variable and the fix).
    """
    raw = environ.get("MPIDL_TIMEOUT")
    if raw is None or raw.strip() == "":
        return None
    if raw.strip().lower() in ("off", "none", "no"):
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"MPIDL_TIMEOUT={raw!r} is not a number of seconds >= 0; set it "
                         "to e.g. 600, or 0 to turn the watchdog off")
    return value


def current() -> "Watchdog | None":
    """The running watchdog of this process, or None."""
    return _current


def start_for(world: Any) -> "Watchdog | None":
    """Start the watchdog over ``world`` if the job wants one. Collective over ``world``.

    Called by :func:`mpidl.comm.world` when it makes the world communicator. The ranks
    agree (one allreduce), so that all of them start it or none.
    """
    global _current
    if world.size == 1 or _current is not None:
        return _current
    from mpi4py import MPI

    env = timeout_from_env()
    want = env != 0.0 and (_wanted or env is not None)
    multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    votes = world.mpi_comm.allgather((bool(want), bool(multiple)))
    if not any(w for w, _ in votes):
        return None
    if not all(m for _, m in votes):
        if world.rank == 0:
            print("mpidl: warning: the watchdog needs MPI_THREAD_MULTIPLE (mpi4py's default "
                  "thread level); this MPI gives less, so hangs are not detected",
                  file=sys.stderr, flush=True)
        return None
    _current = Watchdog(world, env or DEFAULT_TIMEOUT)
    return _current


def set_timeout(seconds: float) -> None:
    """Change the running watchdog's timeout (every rank should pass the same value)."""
    if _current is not None:
        _current.timeout = float(seconds)


class Watchdog:
    """The watchdog thread of one rank. Use :func:`start_for`; collective over ``world``.

    Args:
        world: the world :class:`~mpidl.comm.mpi.MpiCommunicator`.
        timeout: seconds a collective may wait before the job is ended.
    """

    def __init__(self, world: Any, timeout: float) -> None:
        self.comm = world.mpi_comm.Dup()
        self.rank, self.size = world.rank, world.size
        self.timeout = float(timeout)
        self.exited: dict[int, tuple[float, Any]] = {}  # rank -> (when we heard, code)
        self.exit_code: Any = None
        self._alerted_at = 0.0
        self._reporting = False
        self._sends: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one reporter, one message loop at a time
        self.thread = threading.Thread(target=self._run, name="mpidl-watchdog", daemon=True)
        self.thread.start()
        atexit.register(self._at_exit)

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(POLL):
            try:
                with self._lock:
                    self._serve()
                    self._look()
            except Exception as e:  # the watchdog must never be what kills a job
                sys.stderr.write(f"rank {self.rank}/{self.size}: mpidl watchdog failed: "
                                 f"{type(e).__name__}: {e}\n")
                return

    def _serve(self) -> dict[int, dict]:
        """Handle every message that has arrived; return the states received."""
        from mpi4py import MPI

        states = {}
        while True:
            status = MPI.Status()
            message = self.comm.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
            if message is None:
                break
            payload = message.recv()
            source, tag = status.Get_source(), status.Get_tag()
            if tag == _TAG_EXIT:
                self.exited.setdefault(source, (time.monotonic(), payload))
            elif tag == _TAG_ASK:
                self._dump_stack(f"asked by rank {source}: {payload}")
                self._send(self.state(), source, _TAG_STATE)
            elif tag == _TAG_STATE:
                states[source] = payload
            elif tag == _TAG_ALERT and self.rank == 0 and not self._reporting:
                self._report(*payload)
        self._sends = [r for r in self._sends if not r.Test()]
        return states

    def _look(self) -> None:
        """End the job if this rank's wait outlasts the timeout or a needed rank's exit."""
        now = time.monotonic()
        for ledger in all_ledgers():
            entry = ledger.inflight
            if entry is None or not entry.start:
                continue
            where = f"{entry.describe(now)} on {ledger.key!r}"
            # A point-to-point wait needs its peer only; a collective every member.
            needed = ledger.world_ranks if entry.peer is None else (entry.peer,)
            for r in (r for r in needed if r in self.exited):
                if now - max(self.exited[r][0], entry.start) >= min(EXIT_GRACE, self.timeout):
                    return self._trouble(f"rank {r} has exited (status {self.exited[r][1]}) "
                                         f"while rank {self.rank} waits in {where}, which "
                                         "needs it", ledger.key, entry)
            limit = self.timeout * (PATIENCE if entry.patient else 1)
            if now - entry.start >= limit:
                allowed = (f"{PATIENCE} times the timeout, a patient wait ({entry.patient})"
                           if entry.patient else "the timeout")
                return self._trouble(f"rank {self.rank} has waited in {where} longer than "
                                     f"{allowed} ({limit:g} s: MPIDL_TIMEOUT or the "
                                     "trainer's 'timeout' key)", ledger.key, entry)

    def _trouble(self, reason: str, key: str, entry: Any) -> None:
        """Rank 0 reports; another rank alerts rank 0, and reports itself if rank 0 has
        not ended the job a while later (rank 0 may be the stopped one)."""
        wait = {"key": key, "seq": entry.seq, "op": entry.op, "site": entry.site,
                "peer": entry.peer}
        now = time.monotonic()
        if self.rank == 0:
            self._report(reason, wait)
        elif not self._alerted_at:
            self._alerted_at = now
            self._send((reason, wait), 0, _TAG_ALERT)
        elif now - self._alerted_at > 2 * ANSWER + 2 * POLL:
            self._report(reason + "; rank 0 did not end the job, so this rank does", wait)

    # -- reporting ------------------------------------------------------------------------
    def state(self) -> dict:
        """What this rank is doing, as plain data."""
        return {"rank": self.rank, "now": time.monotonic(), "exiting": self.exit_code,
                "ledgers": [ledger.snapshot() for ledger in all_ledgers()]}

    def _send(self, payload: Any, dest: int, tag: int) -> None:
        self._sends.append(self.comm.isend(payload, dest=dest, tag=tag))

    def _report(self, reason: str, wait: dict | None = None) -> None:
        """Ask every rank for its state, print the report, abort the job. Never returns."""
        from mpi4py import MPI

        self._reporting = True
        for r in range(self.size):
            if r != self.rank:
                self._send(reason, r, _TAG_ASK)
        states = {self.rank: self.state()}
        deadline = time.monotonic() + ANSWER
        while len(states) < self.size and time.monotonic() < deadline:
            states.update(self._serve())
            time.sleep(0.05)
        self._dump_stack(reason)
        sys.stderr.write(format_report(reason, states, self.size, self.exited, wait) + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
        MPI.COMM_WORLD.Abort(EXIT_HUNG)

    def _dump_stack(self, why: str) -> None:
        """This rank's last collectives and every thread's Python stack, on stderr."""
        prefix = f"rank {self.rank}/{self.size}: "
        lines = [f"mpidl watchdog ({why}):"]
        for ledger in all_ledgers():
            recent = [e.describe() for e in ledger.recent]
            if ledger.inflight is not None:
                recent.append("now in " + ledger.inflight.describe())
            if recent:
                lines.append(f"collectives on {ledger.key!r}, last first:")
                lines += [f"  {text}" for text in reversed(recent)]
        with tempfile.TemporaryFile(mode="w+") as tmp:
            faulthandler.dump_traceback(file=tmp, all_threads=True)
            tmp.seek(0)
            lines += ["Python stack of every thread:"] + tmp.read().rstrip("\n").split("\n")
        sys.stderr.write("".join(prefix + line + "\n" for line in lines))
        sys.stderr.flush()

    # -- exit -----------------------------------------------------------------------------
    def note_exit(self, code: Any) -> None:
        """Remember this rank's exit status, for the other ranks' reports."""
        self.exit_code = code

    def _at_exit(self) -> None:
        """Tell every rank this one is leaving; wait for all of them to leave too.

        Runs at interpreter exit, before mpi4py's MPI_Finalize (atexit handlers run last
        registered first, and mpi4py's finalizer runs after them).
        """
        from mpi4py import MPI

        if MPI.Is_finalized():
            return
        code = 0 if self.exit_code is None else self.exit_code
        with self._lock:
            for r in range(self.size):
                if r != self.rank:
                    self._send(code, r, _TAG_EXIT)
        while len(self.exited) < self.size - 1:  # the thread collects the others' notices
            if not self.thread.is_alive():
                with self._lock:
                    self._serve()
            time.sleep(0.01)
        self._stop.set()
        self.thread.join()
        MPI.Request.Waitall(self._sends)


def format_report(reason: str, states: dict[int, dict], size: int,
                  exited: dict[int, tuple[float, Any]], wait: dict | None = None) -> str:
    """The watchdog's summary: who waits where, who never arrived, who did not answer.

    ``wait`` (key, seq, op, site) is the collective the reporting rank found stuck.
    """
    lines = [f"mpidl watchdog: {reason}; aborting all {size} ranks (exit status {EXIT_HUNG})."]
    if wait is not None and wait.get("peer") is not None:
        lines.append(f"  {wait['op']} p2p #{wait['seq']} at {wait['site']} on {wait['key']!r} "
                     f"is point-to-point: it waits for world rank {wait['peer']} only "
                     "(its line below says where that rank is instead)")
    elif wait is not None:
        lines += _who_waits_where(states, wait["key"])
    for rank in range(size):
        state = states.get(rank)
        if state is None:
            why = (f"exited with status {exited[rank][1]}" if rank in exited else
                   f"no answer in {ANSWER:g} s: stopped, dead, or holding the GIL")
            lines.append(f"  rank {rank}: {why}")
            continue
        waits = [(ledger["key"], ledger["inflight"]) for ledger in state["ledgers"]
                 if ledger["inflight"]]
        if waits:
            where = "; ".join(
                f"in {_what(e)} at {e['site']} on {key!r} for "
                f"{state['now'] - e['start']:.1f} s" for key, e in waits)
        else:
            last = [(ledger["key"], ledger["recent"][-1]) for ledger in state["ledgers"]
                    if ledger["recent"]]
            done = "; ".join(f"{e['op']} #{e['seq']} at {e['site']} on {key!r}"
                             for key, e in last) or "none"
            where = f"in no collective (last finished: {done})"
        if state.get("exiting") is not None:
            where = f"exiting with status {state['exiting']}, " + where
        lines.append(f"  rank {rank}: {where}")
    return "\n".join(lines)


def _who_waits_where(states: dict[int, dict], key: str) -> list[str]:
    """Lines grouping the members of communicator ``key`` by the collective they wait in.

    The collective most of them wait in (ties: the one of the lowest rank) is the one
    the others "never arrived" at.
    """
    members: set[int] = set()
    groups: dict[tuple, list[int]] = {}
    for rank, state in sorted(states.items()):
        for ledger in state["ledgers"]:
            if ledger["key"] == key:
                members.update(ledger["world_ranks"])
                e = ledger["inflight"]
                if e and e.get("peer") is None:
                    groups.setdefault((e["seq"], e["op"], e["site"]), []).append(rank)
    if not groups:
        return []
    (seq, op, site), ranks = max(groups.items(), key=lambda g: (len(g[1]), -g[1][0]))
    absent = sorted(members - set(ranks))
    return [f"  in {op} #{seq} at {site} on {key!r}: ranks {_ranks(ranks)}; "
            f"never arrived: {_ranks(absent) or 'none'}"]


def _what(e: dict) -> str:
    """``allreduce_ #3``, or ``recv_ p2p #2 from world rank 1``."""
    if e.get("peer") is None:
        return f"{e['op']} #{e['seq']}"
    way = "to" if "send" in e["op"] else "from"
    return f"{e['op']} p2p #{e['seq']} {way} world rank {e['peer']}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
