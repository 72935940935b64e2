"""A per-rank timeline of compute, communication and input, written as a Chrome trace.

``mpidl train --trace`` writes ``RUN_DIR/trace.json``; open it in https://ui.perfetto.dev
or ``chrome://tracing``. Each rank is a process (``pid`` = rank, named ``rank N``) with
one track per category (``compute``, ``comm``, ``input``), so a straggler or an exposed
allreduce shows as a gap lined up across ranks. The file is the Trace Event Format's
JSON object form: ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` with complete
(``"ph": "X"``) events whose ``ts`` and ``dur`` are microseconds.

Each rank records its own events in memory; at the end they are gathered to rank 0,
which alone writes the file::

    timeline = Timeline(rank=comm.rank, enabled=config.trace)
    comm.barrier(); timeline.reset_origin()     # a common time zero for all ranks
    ...                                          # StepTimer(timeline=timeline) records
    timeline.write(os.path.join(run_dir, "trace.json"), gather=comm.allgather_obj)

Clocks: times are ``time.perf_counter()`` seconds relative to the origin each rank takes
right after a barrier, so ranks line up to within the barrier's exit skew (microseconds
on one node, tens of microseconds across nodes).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Callable, Iterator, Sequence

from hpc.files import write_text

TRACKS = ("compute", "comm", "input")


class Timeline:
    """The events of one rank.

    Args:
        rank: this rank (the trace's ``pid``).
        enabled: record, or make every call a cheap no-op.
        max_events: events kept at most (later ones are counted, not kept), which bounds
            memory and the size of the gather on long runs.
    """

    def __init__(self, rank: int = 0, enabled: bool = True, max_events: int = 200_000) -> None:
        self.rank = rank
        self.enabled = enabled
        self.max_events = max_events
        self.origin = time.perf_counter()
        # (name, track, start_us, duration_us, args): tuples keep the gather small.
        self.events: list[tuple[str, str, float, float, dict | None]] = []
        self.dropped = 0

    def reset_origin(self) -> None:
        """Take now as time zero (call on every rank right after a barrier)."""
        self.origin = time.perf_counter()

    def add(self, name: str, track: str, start: float, duration: float,
            args: dict[str, Any] | None = None) -> None:
        """Record a span that began at ``start`` (``perf_counter`` seconds) and lasted
        ``duration`` s."""
        if not self.enabled:
            return
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append((name, track, (start - self.origin) * 1e6, duration * 1e6, args))

    @contextlib.contextmanager
    def span(self, name: str, track: str = "compute", **args: Any) -> Iterator[None]:
        """Record the time inside the ``with`` block as one event."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, track, start, time.perf_counter() - start, args or None)

    def local_trace(self) -> dict[str, Any]:
        """This rank's events as a picklable dict (what :meth:`write` gathers)."""
        return {"rank": self.rank, "events": self.events, "dropped": self.dropped}

    def write(self, path: str | os.PathLike,
              gather: Callable[[Any], Sequence[Any] | None] | None = None) -> str | None:
        """Gather every rank's events to rank 0 and write one trace file there.

        Collective when ``gather`` is: call it on every rank. ``enabled`` must be the same
        on every rank (it comes from the config); when it is False nothing is gathered
        or written.

        Args:
            path: the ``trace.json`` to write.
            gather: ``gather(obj) -> list`` of every rank's obj on rank 0 (other ranks may
                get None), e.g. ``comm.allgather_obj``; None for a single process.

        Returns:
            ``path`` on the rank that wrote it, else None.
        """
        if not self.enabled:
            return None
        local = self.local_trace()
        gathered = gather(local) if gather is not None else [local]
        if self.rank != 0 or gathered is None:
            return None
        return write_trace(path, list(gathered))


def trace_events(traces: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trace Event Format events (metadata first) of several ranks' local traces."""
    events: list[dict[str, Any]] = []
    for trace in traces:
        pid = int(trace["rank"])
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": f"rank {pid}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"sort_index": pid}})
        tracks = list(TRACKS) + sorted({e[1] for e in trace["events"]} - set(TRACKS))
        tid = {name: i for i, name in enumerate(tracks)}
        for name, i in tid.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": i,
                           "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": i,
                           "args": {"sort_index": i}})
        for name, track, ts, dur, args in trace["events"]:
            event = {"name": name, "cat": track, "ph": "X", "pid": pid, "tid": tid[track],
                     "ts": round(ts, 3), "dur": round(dur, 3)}
            if args:
                event["args"] = args
            events.append(event)
        if trace.get("dropped"):
            events.append({"name": f"{trace['dropped']} events not recorded (max_events)",
                           "ph": "i", "s": "p", "pid": pid, "tid": 0,
                           "ts": round(max((e[2] + e[3] for e in trace["events"]), default=0), 3)})
    return events


def write_trace(path: str | os.PathLike, traces: Sequence[dict[str, Any]]) -> str:
    """Write the local traces of several ranks as one Chrome trace JSON file; return its path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"traceEvents": trace_events(traces), "displayTimeUnit": "ms"}
    return write_text(path, json.dumps(doc, separators=(",", ":")))
