"""What a training run prints: rank 0 speaks, other ranks only when something is wrong.

* :class:`Logger`: ``info`` on rank 0 only, ``warning`` from any rank (to stderr, with
  the rank in front).
* :class:`ProgressBar`: a tqdm bar with ETA on rank 0 when stdout is a terminal; in a
  batch job (output to a file) a plain line every ``plain_every`` seconds instead, since
  a bar's carriage returns make a Slurm log unreadable; nothing on other ranks.
* :func:`format_table`, :func:`format_summary`: the final table.
* :func:`report_first_error`: an error every rank found, said once.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Sequence, TextIO


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``"1m15s"``, ``3725`` -> ``"1h02m05s"``, ``4.2`` -> ``"4.2s"``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def format_value(value: Any) -> str:
    """A compact rendering of a metric: 4 significant digits, ``12.3k`` for large rates,
    ``5.76e+26`` past a million (a diverging loss), ``-`` for none (a JSON null: a loss of
    no counted sample, or one that was not finite)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if abs(value) >= 1e6:
            return f"{value:.3g}"
        if abs(value) >= 10_000:
            return f"{value / 1000:.1f}k"
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.2e}"
        return f"{value:.4g}"
    return str(value)


class Logger:
    """Rank-aware printing.

    Args:
        rank: this process's rank; only rank 0 prints :meth:`info`.
        size: the number of ranks (shown in warnings).
        stream: where rank 0's messages go (stdout).
    """

    def __init__(self, rank: int = 0, size: int = 1, stream: TextIO | None = None) -> None:
        self.rank = rank
        self.size = size
        self.stream = stream

    def info(self, message: str) -> None:
        """Print on rank 0 only (through the progress bar if one is drawing)."""
        if self.rank == 0:
            _print(message, self.stream or sys.stdout)

    def warning(self, message: str) -> None:
        """Print on any rank, to stderr, as ``rank R/N: warning: message``."""
        _print(f"rank {self.rank}/{self.size}: warning: {message}", sys.stderr)


def report_first_error(comm: Any, error: str | None, prog: str) -> bool:
    """Whether any rank has an ``error``; if so rank 0 prints the first rank's once, as
    ``PROG: error: ...`` on stderr. Collective: every rank passes its error or None.

    For errors every rank finds alike (a configuration, a dataset, a checkpoint: each
    rank reads the same files), reported as one message instead of one per rank.
    """
    first = next((e for e in comm.allgather_obj(error) if e), None)
    if first is not None and comm.rank == 0:
        print(f"{prog}: error: {first}", file=sys.stderr, flush=True)
    return first is not None


def _print(message: str, stream: TextIO) -> None:
    bar = ProgressBar.active
    if bar is not None and bar._tqdm is not None and stream in (sys.stdout, sys.stderr):
        bar._tqdm.write(message, file=stream)
    else:
        print(message, file=stream, flush=True)


class ProgressBar:
    """Rank 0's progress over ``total`` steps, with ETA.

    Args:
        total: the number of steps the run will take in all.
        enabled: False on every rank but 0.
        mode: ``"auto"`` (a tqdm bar if ``file`` is a terminal, else plain lines),
            ``"always"`` (a tqdm bar even when not a terminal) or ``"never"`` (nothing).
        initial: steps already done (a resumed run).
        desc: the label in front.
        plain_every: seconds between plain lines (batch jobs).
        file: the output stream (stdout).
    """

    active: "ProgressBar | None" = None

    def __init__(self, total: int, enabled: bool = True, mode: str = "auto", initial: int = 0,
                 desc: str = "train", plain_every: float = 30.0,
                 file: TextIO | None = None) -> None:
        if mode not in ("auto", "always", "never"):
            raise ValueError(f"progress mode {mode!r}: use 'auto', 'always' or 'never'")
        self.total = int(total)
        self.n = int(initial)
        self.initial = int(initial)
        self.desc = desc
        self.plain_every = plain_every
        self.file = file or sys.stdout
        self.postfix: dict[str, Any] = {}
        self._tqdm = None
        self._start = time.monotonic()
        self._last_line = self._start
        self.enabled = enabled and mode != "never"
        self.plain = False
        if not self.enabled:
            return
        is_tty = bool(getattr(self.file, "isatty", lambda: False)())
        if mode == "always" or is_tty:
            from tqdm import tqdm  # here: only when a bar is drawn (a terminal, or always)

            self._tqdm = tqdm(total=self.total, initial=self.initial, desc=desc, unit="step",
                              file=self.file, dynamic_ncols=True, smoothing=0.1)
        else:
            self.plain = True
        ProgressBar.active = self

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by ``n`` steps and show ``postfix`` fields (loss, accuracy, ...)."""
        if not self.enabled:
            return
        self.n += n
        if postfix:
            self.postfix.update(postfix)
        if self._tqdm is not None:
            if postfix:
                self._tqdm.set_postfix({k: format_value(v) for k, v in self.postfix.items()},
                                       refresh=False)
            self._tqdm.update(n)
        elif self.plain:
            now = time.monotonic()
            if now - self._last_line >= self.plain_every:
                self._last_line = now
                print(self.line(), file=self.file, flush=True)

    def eta(self) -> float:
        """Seconds left, from the mean step time since this bar started (inf before a step)."""
        done = self.n - self.initial
        if done <= 0:
            return math.inf
        return (time.monotonic() - self._start) / done * max(self.total - self.n, 0)

    def line(self) -> str:
        """The plain progress line: ``train 120/1000 (12%) loss 0.41 ... elapsed 12s eta 1m32s``."""
        pct = 100.0 * self.n / self.total if self.total else 100.0
        fields = " ".join(f"{k} {format_value(v)}" for k, v in self.postfix.items())
        elapsed = time.monotonic() - self._start
        return (f"{self.desc} {self.n}/{self.total} ({pct:.0f}%) {fields}".rstrip()
                + f" | elapsed {format_duration(elapsed)} eta {format_duration(self.eta())}")

    def write(self, message: str) -> None:
        """Print a line without breaking the bar (rank 0's messages during training)."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.write(message, file=self.file)
        else:
            print(message, file=self.file, flush=True)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
        elif self.plain and self.enabled:
            print(self.line(), file=self.file, flush=True)
            self.plain = False
        if ProgressBar.active is self:
            ProgressBar.active = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
                 title: str | None = None) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned, a rule under the header."""
    cells = [[format_value(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def is_number(v: Any) -> bool:
        return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v in (None, "-")

    numeric = [bool(rows) and all(is_number(row[i]) for row in rows) for i in range(len(headers))]

    def fmt(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    lines = [title] if title else []
    lines += [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells]
    return "\n".join(lines)


def format_summary(records: Sequence[dict[str, Any]], totals: dict[str, Any] | None = None) -> str:
    """The final summary: a table of evaluations, then ``totals`` as ``key: value`` lines.

    Args:
        records: metrics records (:mod:`mpidl.train.metrics`); the ``kind == "eval"`` ones
            make the table (epoch, step, test loss, test accuracy, and the mean train loss
            and accuracy of the ``train`` records of that epoch when there are any).
        totals: e.g. ``{"wall time": "2m31s", "samples/s": 2412.0, "ranks": 2}``.
    """
    evals = [r for r in records if r.get("kind") == "eval"]
    rows = []
    for r in evals:
        train = [t for t in records
                 if t.get("kind") == "train" and t.get("epoch") == r.get("epoch")]
        loss = [t["loss"] for t in train if isinstance(t.get("loss"), (int, float))]
        acc = [t["accuracy"] for t in train if isinstance(t.get("accuracy"), (int, float))]
        rows.append([r.get("epoch", ""), r.get("step", ""),
                     sum(loss) / len(loss) if loss else "-", sum(acc) / len(acc) if acc else "-",
                     r.get("test_loss", "-"), r.get("test_accuracy", "-")])
    parts = []
    if rows:
        parts.append(format_table(["epoch", "step", "train loss", "train acc", "test loss",
                                   "test acc"], rows))
    if totals:
        width = max(len(k) for k in totals)
        parts.append("\n".join(f"{k + ':':<{width + 1}} {format_value(v)}"
                               for k, v in totals.items()))
    return "\n\n".join(parts)
