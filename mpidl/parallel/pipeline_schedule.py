"""Pipeline schedules as data: each rank's ordered forwards and backwards, and a simulator.

Notation (as in Narayanan et al. 2021, arXiv 2104.04473): ``p`` stages (pipeline ranks),
``m`` microbatches per step, ``v`` model chunks per rank (interleaving). The model is cut
into ``P = p * v`` parts; part ``k`` lives on rank ``k % p`` as its local chunk
``k // p`` (Megatron-LM's placement: rank 0 holds parts 0, p, 2p, ...). A schedule is,
for every rank, the list of :class:`Action` it runs in order::

    schedule("1f1b", p=4, m=8)[0]
    # [F(0, 0), F(0, 1), F(0, 2), F(0, 3), B(0, 0), F(0, 4), B(0, 1), ...]

The messages follow from the actions and need no listing: the forward of part ``k > 0``
for microbatch ``i`` receives its input activation from part ``k - 1``, the forward of
part ``k < P - 1`` sends its output to part ``k + 1``; a backward receives its output
gradient from part ``k + 1`` (unless ``k`` is the last part, which holds the loss) and
sends its input gradient to part ``k - 1`` (unless ``k == 0``). :func:`messages` spells
that rule out; the engine (:mod:`mpidl.parallel.pipeline`) and the simulator both use it.

Schedules (every part runs its forwards, and its backwards, in microbatch order 0..m-1,
so gradients accumulate in the single-rank order):

- ``gpipe``: every forward, then every backward (Huang et al. 2019). Holds all ``m``
  microbatches' activations.
- ``1f1b``: PipeDream-Flush / Megatron's non-interleaved schedule: rank ``r`` runs
  ``min(p - r - 1, m)`` warm-up forwards, then alternates one forward and one backward,
  then the remaining backwards. Rank ``r`` holds at most ``p - r`` microbatches.
- ``interleaved``: Megatron-LM's interleaved 1F1B with ``v`` chunks per rank
  (``forward_backward_pipelining_with_interleaving``, microbatch group size ``p``):
  warm-up ``2 (p - r - 1) + (v - 1) p`` chunk-forwards, then 1F1B over chunks. Needs
  ``m % p == 0``, as Megatron's schedule with its default group size does.

Every schedule needs ``m >= p``: with fewer microbatches than stages some stage has
nothing to do for most of the step (torchtitan #775 hung there; PyTorch refuses too).

With unit-time forwards and backwards (a chunk taking ``1 / v`` of a stage), the
simulator's idle fraction (idle time over busy time, per rank) is exactly
``(p - 1) / m`` for gpipe and 1f1b and ``(p - 1) / (v m)`` for interleaved: the
formulas of Narayanan et al. (tested in tests/unit/test_pipeline_schedule.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from mpidl.names import PIPELINE_SCHEDULES as SCHEDULES


@dataclass(frozen=True)
class Action:
    """One forward (``kind == "F"``) or backward (``"B"``) of model part ``part`` on
    microbatch ``microbatch``."""

    kind: str
    part: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}({self.part}, {self.microbatch})"


@dataclass(frozen=True)
class Message:
    """An activation (``kind == "activation"``, to part ``part``'s forward) or an output
    gradient (``"gradient"``, to part ``part``'s backward) of one microbatch."""

    kind: str
    part: int
    microbatch: int


def messages(action: Action, parts: int) -> tuple[Message | None, Message | None]:
    """``(received, sent)`` by ``action`` in a model of ``parts`` parts (None: none).

    The forward of part k receives ``activation(k, i)`` (made by part k - 1) and sends
    ``activation(k + 1, i)``; its backward receives ``gradient(k, i)`` (made by part
    k + 1) and sends ``gradient(k - 1, i)``.
    """
    k, i = action.part, action.microbatch
    if action.kind == "F":
        return (Message("activation", k, i) if k > 0 else None,
                Message("activation", k + 1, i) if k < parts - 1 else None)
    return (Message("gradient", k, i) if k < parts - 1 else None,
            Message("gradient", k - 1, i) if k > 0 else None)


def check_layout(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ValueError naming what works if schedule ``name`` cannot run ``p`` stages,
    ``m`` microbatches and ``v`` chunks per rank (not collective)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    for what, n in (("stages", p), ("microbatches", m), ("chunks per rank", v)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"pipeline schedule {name}: {what}={n!r} must be a positive int")
    if m < p:
        raise ValueError(f"pipeline schedule {name}: {m} microbatches for {p} stages; use at "
                         f"least {p} (fewer leave stages idle for most of the step)")
    if name != "interleaved" and v != 1:
        raise ValueError(f"pipeline schedule {name} runs one chunk per rank, not {v}; use "
                         "schedule='interleaved' for several")
    if name == "interleaved" and m % p:
        raise ValueError(f"pipeline schedule interleaved: {m} microbatches is not a multiple "
                         f"of the {p} stages (Megatron's microbatch groups of p); use "
                         f"{m - m % p or p} or {m + p - m % p}")


def flags_problem(schedule: str | None, virtual: int | None) -> str | None:
    """What is wrong with the user's ``--pipeline-schedule`` and ``--virtual-stages``
    together (None: nothing; None for either: not given), the one rule ``mpidl train``
    and ``mpidl plan --layouts`` both refuse with (exit 2).

    ``interleaved`` with one chunk per stage is exactly 1F1B (the same actions:
    :func:`interleaved` at ``v = 1``), so a run that asks for it asked for something it
    would not get: the bubble it was after is ``(p - 1) / (v m)`` at ``v >= 2``. The
    engine's own :func:`schedule` still takes it (tests compare the two).
    """
    if schedule == "interleaved" and virtual == 1:
        return ("--virtual-stages=1 is plain 1F1B: --pipeline-schedule=interleaved needs 2 "
                "or more model chunks per stage; use --virtual-stages=2 or more, or "
                "--pipeline-schedule=1f1b")
    return None


def gpipe(p: int, m: int) -> list[list[Action]]:
    """Every rank: all forwards, then all backwards, in microbatch order."""
    return [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
            for r in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """PipeDream-Flush: ``min(p - r - 1, m)`` warm-up forwards, one forward and one
    backward in turn, then the remaining backwards."""
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", r, warmup + i), Action("B", r, i)]
        acts += [Action("B", r, i) for i in range(m - warmup, m)]
        ranks.append(acts)
    return ranks


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B (group size p): the ``k``-th chunk-forward of a
    rank runs chunk ``(k mod pv) // p`` on microbatch ``(k // pv) p + k mod p``; its
    ``k``-th chunk-backward the chunks in reverse order."""
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    ranks = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)

        def f(k: int) -> Action:
            chunk, i = unit(k, True)
            return Action("F", chunk * p + r, i)

        def b(k: int) -> Action:
            chunk, i = unit(k, False)
            return Action("B", chunk * p + r, i)

        acts = [f(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [f(warmup + k), b(k)]
        acts += [b(k) for k in range(total - warmup, total)]
        ranks.append(acts)
    return ranks


def schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Each rank's actions for schedule ``name`` (:data:`SCHEDULES`); checked first
    (:func:`check_layout`), and validated (:func:`validate`)."""
    check_layout(name, p, m, v)
    ranks = {"gpipe": lambda: gpipe(p, m), "1f1b": lambda: one_f_one_b(p, m),
             "interleaved": lambda: interleaved(p, m, v)}[name]()
    validate(ranks, p, m, v)
    return ranks


class ScheduleError(ValueError):
    """A schedule that cannot run: an action missing, twice, misplaced, out of order,
    or a deadlock."""


def validate(ranks: list[list[Action]], p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError unless every part runs one forward and one backward of every
    microbatch, on its own rank (``part % p``), forwards and backwards each in
    microbatch order, every backward after its forward; and the ranks' lists run
    against each other without deadlock (:func:`simulate`)."""
    parts = p * v
    if len(ranks) != p:
        raise ScheduleError(f"{len(ranks)} action lists for {p} ranks")
    for r, acts in enumerate(ranks):
        seen: set[Action] = set()
        last = {("F", k): -1 for k in range(parts)} | {("B", k): -1 for k in range(parts)}
        for a in acts:
            if a.part % p != r or not 0 <= a.part < parts or not 0 <= a.microbatch < m:
                raise ScheduleError(f"rank {r} runs {a}: part {a.part} of {parts} lives on "
                                    f"rank {a.part % p}, microbatches are 0..{m - 1}")
            if a in seen:
                raise ScheduleError(f"rank {r} runs {a} twice")
            if a.kind == "B" and Action("F", a.part, a.microbatch) not in seen:
                raise ScheduleError(f"rank {r} runs {a} before its forward")
            if a.microbatch != last[(a.kind, a.part)] + 1:
                raise ScheduleError(f"rank {r} runs {a} after microbatch "
                                    f"{last[(a.kind, a.part)]} of that part: each part runs "
                                    "its microbatches in order 0..m-1 (the gradient "
                                    "accumulation order)")
            last[(a.kind, a.part)] = a.microbatch
            seen.add(a)
        if len(seen) != 2 * m * (parts // p):
            raise ScheduleError(f"rank {r} runs {len(seen)} actions, not {2 * m * parts // p}")
    simulate(ranks, p, v)


@dataclass
class Simulation:
    """What :func:`simulate` found.

    Attributes:
        makespan: when the last rank finished.
        busy: per rank, the time spent computing.
        timeline: per rank, ``(start, end, action)`` of every action.
        bubble: idle over busy time, per rank: ``(makespan - busy) / busy``, the largest.
    """

    makespan: float
    busy: list[float]
    timeline: list[list[tuple[float, float, Action]]] = field(default_factory=list)

    @property
    def bubble(self) -> float:
        return max((self.makespan - b) / b for b in self.busy)


def simulate(ranks: list[list[Action]], p: int, v: int = 1, forward: float = 1.0,
             backward: float = 1.0, blocking_sends: bool = False) -> Simulation:
    """Run every rank's actions against each other; raise ScheduleError on a deadlock.

    Each action first receives its input message (:func:`messages`), computes (a
    forward of one part takes ``forward / v``, a backward ``backward / v``: a chunk is
    ``1 / v`` of a stage), then sends its output. ``blocking_sends=False`` is the
    engine's order: a send is posted and never waits (MPI ``Isend``, completed at the
    end of the step), a receive waits for its message only. ``blocking_sends=True``
    models a send that waits for its receive to be posted (MPI's rendezvous protocol
    for large messages), so two neighbours that both send first wait for ever; 1F1B's
    steady state does exactly that.
    """
    parts = p * v
    ops = []  # per rank: [("recv"|"compute"|"send", Message|Action)]
    for acts in ranks:
        seq = []
        for a in acts:
            got, sent = messages(a, parts)
            if got is not None:
                seq.append(("recv", got))
            seq.append(("compute", a))
            if sent is not None:
                seq.append(("send", sent))
        ops.append(seq)
    owner = {}  # message -> the rank that receives it
    for r, seq in enumerate(ops):
        for what, x in seq:
            if what == "recv":
                owner[x] = r
    pc, clock = [0] * p, [0.0] * p
    busy = [0.0] * p
    posted: dict[Message, float] = {}
    timeline: list[list] = [[] for _ in range(p)]

    def current(r: int):
        return ops[r][pc[r]] if pc[r] < len(ops[r]) else (None, None)

    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pc[r] < len(ops[r]):
                what, x = ops[r][pc[r]]
                if what == "compute":
                    took = (forward if x.kind == "F" else backward) / v
                    timeline[r].append((clock[r], clock[r] + took, x))
                    clock[r] += took
                    busy[r] += took
                elif what == "send" and x not in owner:
                    raise ScheduleError(f"rank {r} sends {x}, which no rank receives")
                elif what == "send" and not blocking_sends:
                    posted[x] = clock[r]
                elif what == "send":  # rendezvous: both at the matching op
                    dest = owner[x]
                    if current(dest) != ("recv", x):
                        break
                    clock[r] = clock[dest] = max(clock[r], clock[dest])
                    pc[dest] += 1
                elif x in posted:  # recv of a posted message
                    clock[r] = max(clock[r], posted.pop(x))
                else:
                    break
                pc[r] += 1
                moved = True
    stuck = [r for r in range(p) if pc[r] < len(ops[r])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(
            f"rank {r} waits to {ops[r][pc[r]][0]} {ops[r][pc[r]][1]}" for r in stuck))
    return Simulation(max(clock), busy, timeline)


def peak_in_flight(actions: Iterable[Action]) -> int:
    """The most part-microbatches whose forward ran and whose backward has not: the
    activations a rank holds at its peak (1F1B rank r: p - r; gpipe: m)."""
    held = peak = 0
    for a in actions:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


__all__ = ["Action", "Message", "SCHEDULES", "ScheduleError", "Simulation", "check_layout",
           "gpipe", "interleaved", "messages", "one_f_one_b", "peak_in_flight", "schedule",
           "simulate", "validate"]
