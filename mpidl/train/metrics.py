"""Training metrics: a JSONL writer, per-step time split, and throughput.

``RUN_DIR/metrics.jsonl`` holds one JSON object per line, appended and flushed as it is
written so that a killed job keeps what it logged. Every record has ``kind`` and ``time``
(unix seconds); the trainer writes these kinds (the names :mod:`mpidl.train.plot` reads)::

    {"kind": "train", "step": 100, "epoch": 0, "loss": 0.41, "accuracy": 0.86,
     "lr": 0.002, "samples_per_s": 2400.0, "time_step": 0.026, "time_compute": 0.020,
     "time_comm": 0.004, "time_input": 0.002, "time": 1733000000.0}
    {"kind": "eval", "step": 390, "epoch": 0, "test_loss": 0.19, "test_accuracy": 0.93, ...}

Non-finite floats (a diverged loss) are written as ``null``: strict JSON has no NaN. A
train record whose steps were all skipped (not finite) has a ``null`` loss and accuracy
(no sample counted); ``skipped_steps``, in train and stop records, counts such steps
since the run began.

The time split of a step (:class:`StepTimer`): *input* is time blocked waiting for the
next batch, *comm* is time blocked waiting for communication (the allreduce handles of
the gradient buckets, any blocking collective), and *compute* is the rest of the step:
forward, backward, optimizer, copies. On a GPU the host runs ahead of the device, so
host clocks measure launch times: there the timer marks each step's start and end with
CUDA events (``StepTimer(clock=mpidl.backend.device_clock(cupy))``) and reads them
once the GPU has passed them (at the latest a step later), so timing adds no host
synchronisation to a step; :attr:`StepTimer.last` may then be the previous step's.
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import time
import warnings
from typing import Any, Callable, Iterator

from hpc.files import write_text

import numpy

CATEGORIES = ("compute", "comm", "input")


def jsonable(value: Any) -> Any:
    """``value`` for strict JSON: NumPy scalars and arrays as Python ones, non-finite floats
    (NaN, inf: strict JSON has none) as None, recursively through dicts, lists, tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (numpy.floating, numpy.integer, numpy.bool_)):
        return jsonable(value.item())
    if isinstance(value, numpy.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


class MetricsWriter:
    """Append records to a JSONL file, one flushed line each.

    Only one rank writes a run's metrics (the trainer passes ``enabled=rank == 0``); a
    disabled writer accepts records and does nothing, so callers need no rank checks.

    Args:
        path: the ``.jsonl`` file; its directory is created; an existing file is appended
            to (a resumed run continues it; see :func:`trim_metrics`).
        enabled: write, or do nothing.
    """

    def __init__(self, path: str | os.PathLike, enabled: bool = True) -> None:
        self.path = os.fspath(path)
        self.enabled = enabled
        self._file = None
        if enabled:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            if self._file.tell() and not _ends_with_newline(self.path):
                # A killed writer's torn last line stays one (torn) line, apart from ours.
                self._file.write("\n")

    def write(self, record: dict[str, Any] | None = None, **fields: Any) -> None:
        """Write one record (a dict and/or keyword fields); adds ``time`` if absent."""
        if self._file is None:
            return
        rec = dict(record or {}, **fields)
        rec.setdefault("time", time.time())
        self._file.write(json.dumps(jsonable(rec), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics file; a torn last line (a killed job) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            warnings.warn(f"{path}:{i}: skipping a line that is not JSON (torn write?)",
                          RuntimeWarning, stacklevel=2)
    return records


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def trim_metrics(path: str | os.PathLike, step: int) -> int:
    """Drop the records with ``step > step`` (work a resumed run redoes); return how many.

    Call it on the writing rank when resuming from the checkpoint of ``step``, before
    opening the :class:`MetricsWriter`. The file is replaced atomically.
    """
    path = os.fspath(path)
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return 0
    records = read_metrics(path)
    kept = [r for r in records if not (isinstance(r.get("step"), int) and r["step"] > step)]
    if len(kept) == len(records) and _ends_with_newline(path):
        return 0  # nothing to drop: the file stays as it is (no rewrite, no space needed)
    write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


class StepTimes(collections.namedtuple("StepTimes", ["total", "compute", "comm", "input"])):
    """Seconds of one step: ``total = compute + comm + input``."""

    __slots__ = ()

    def as_record(self) -> dict[str, float]:
        """Fields for a metrics record: ``time_step``, ``time_compute``, ..."""
        return {"time_step": self.total, "time_compute": self.compute,
                "time_comm": self.comm, "time_input": self.input}


class StepTimer:
    """Split each training step's wall time into compute, communication wait and input wait.

    ::

        timer = StepTimer(timeline=timeline)
        for step in ...:
            with timer.step():
                with timer.measure("input"):
                    batch = next(loader)
                loss = forward_backward(batch)          # counted as compute
                with timer.measure("comm"):
                    ddp.finish_gradient_synchronization()
                optimizer.step()
            times = timer.last                          # StepTimes of this step

    Args:
        timeline: a :class:`mpidl.train.timeline.Timeline` that receives every measured
            span (and the step itself on the compute track), or None.
        sync: called before each clock reading (e.g. ``mpidl.backend.synchronize``) so
            that GPU work is counted where it runs; None on the CPU. A host sync per
            reading: prefer ``clock``.
        clock: a :class:`mpidl.backend.DeviceClock`: a step's total is the GPU's time
            between marks at its start and end (plus the input wait before its start),
            known once the GPU reaches the end mark, which is asked without waiting. A
            step whose mark is not reached yet is recorded at the end of the next step
            (waiting then if need be, rarely: the next step synchronises on its own),
            so :attr:`last` may be the previous step's, or None after the first;
            :meth:`mean` and :meth:`flush` record every step. The comm and input waits
            are the host's, as without a clock.
    """

    def __init__(self, timeline: Any = None, sync: Callable[[], Any] | None = None,
                 clock: Any = None) -> None:
        self.timeline = timeline
        self.sync = sync
        self.clock = clock
        self.last: StepTimes | None = None
        self.totals = dict.fromkeys(("total",) + CATEGORIES, 0.0)
        self.steps = 0
        self._open: dict[str, float] | None = None
        self._step_index = 0
        self._pending: list[tuple] = []  # clock steps whose end mark may not be reached

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    @contextlib.contextmanager
    def step(self, name: str | None = None, start: float | None = None) -> Iterator[None]:
        """Time one step; on exit, :attr:`last` holds its :class:`StepTimes`.

        ``start`` (a ``time.perf_counter()`` reading) backdates the step, e.g. to include
        the wait for its input that happened before the step could be known to exist.
        """
        self._open = {"comm": 0.0, "input": 0.0}
        start = self._now() if start is None else start
        if self.clock is not None:
            before = time.perf_counter() - start  # the input wait ahead of the first mark
            first = self.clock.mark()
        try:
            yield
        finally:
            waits = self._open
            self._open = None
            label = name or f"step {self._step_index}"
            self._step_index += 1
            if self.clock is None:
                self._record(label, start, self._now() - start, waits)
            else:
                self._pending.append((label, start, before, first, self.clock.mark(), waits))
                self._resolve(keep=1)

    def _record(self, label: str, start: float, total: float, waits: dict) -> None:
        compute = max(0.0, total - waits["comm"] - waits["input"])
        self.last = StepTimes(total, compute, waits["comm"], waits["input"])
        for key, value in zip(("total",) + CATEGORIES, self.last):
            self.totals[key] += value
        self.steps += 1
        if self.timeline is not None:
            self.timeline.add(label, "compute", start, total)

    def _resolve(self, keep: int = 0) -> None:
        """Record the clock steps whose end marks are reached, and all but the newest
        ``keep`` in any case (waiting for their marks if need be), oldest first."""
        while self._pending:
            label, start, before, first, last, waits = self._pending[0]
            if len(self._pending) <= keep and not self.clock.reached(last):
                return
            self._pending.pop(0)
            self._record(label, start, before + self.clock.seconds(first, last), waits)

    def flush(self) -> None:
        """Record every step still waiting for its device marks (may wait for the GPU)."""
        if self.clock is not None:
            self._resolve()

    @contextlib.contextmanager
    def measure(self, category: str, name: str | None = None) -> Iterator[None]:
        """Count the time inside as ``category`` (``"comm"`` or ``"input"``)."""
        start = self._now()
        try:
            yield
        finally:
            self.add(category, self._now() - start, start=start, name=name)

    def add(self, category: str, seconds: float, start: float | None = None,
            name: str | None = None) -> None:
        """Count ``seconds`` of waiting measured elsewhere (``start``: its perf_counter).

        Outside a step the time is only drawn on the timeline (e.g. evaluation input).
        """
        if category not in CATEGORIES:
            raise ValueError(f"unknown time category {category!r}; use one of {CATEGORIES}")
        if self._open is not None and category != "compute":
            self._open[category] += seconds
        if self.timeline is not None and start is not None:
            self.timeline.add(name or category, category, start, seconds)

    def mean(self) -> StepTimes:
        """Mean :class:`StepTimes` over all timed steps (zeros before the first)."""
        self.flush()
        n = max(self.steps, 1)
        return StepTimes(*(self.totals[k] / n for k in ("total",) + CATEGORIES))

    def reset(self) -> None:
        """Forget the totals (e.g. after warm-up steps)."""
        self.flush()
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.steps = 0


class Throughput:
    """Samples per second over the last ``window`` steps (a moving window, not since start).

    ``update(samples, seconds)`` after each step; :attr:`rate` is then
    ``sum(samples) / sum(seconds)`` over the window. ``samples`` is the global batch when
    the rate is the job's, the local batch when it is one rank's.
    """

    def __init__(self, window: int = 50) -> None:
        if window < 1:
            raise ValueError(f"Throughput window must be >= 1, got {window}")
        self._items: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self.total_samples = 0.0
        self.total_seconds = 0.0

    def update(self, samples: float, seconds: float) -> float:
        """Record one step; return the current :attr:`rate`."""
        self._items.append((float(samples), float(seconds)))
        self.total_samples += samples
        self.total_seconds += seconds
        return self.rate

    @property
    def rate(self) -> float:
        seconds = sum(s for _, s in self._items)
        return sum(n for n, _ in self._items) / seconds if seconds > 0 else 0.0

    @property
    def overall(self) -> float:
        """Samples per second since the first update."""
        return self.total_samples / self.total_seconds if self.total_seconds > 0 else 0.0
