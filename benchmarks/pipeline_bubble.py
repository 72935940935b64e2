"""The measured bubble of the pipeline schedules (#26) against (p-1)/m and (p-1)/(v m).

Every rank is a stage (``ProcessGrid(world, pipeline=size)``), one thread per rank. Per
schedule and microbatch count: a few steps of :class:`~mpidl.parallel.PipelineModel`
(the real engine: its schedule, its posted sends and waited receives, data parallelism's
wrapper), each timed between barriers; each rank's bubble is the step's idle time over
its busy time (the engine's ``step_seconds - wait_seconds``), the median over the steps;
the table gives the ranks' mean and range beside the formula, and the range of the
engine's own ``wait / (step - wait)`` (what ``mpidl train`` records as
``pipeline_bubble``; :func:`measure` says why it differs). The formula is the schedule's
idle over busy time when every stage's forward takes the same time and every backward
too, whatever their ratio. Two kinds of compute:

- ``--compute real``: a float32 GPT whose parts hold equal blocks (the first and last
  also hold the embedding and the head, a little more work). Meaningful only with a
  core per rank: at p = 4 on 2 cores the ranks share cores, so a stage's wait is also
  its neighbour's wait for a CPU, not the schedule's.
- ``--compute hold``: each part's forward and backward is a fixed-length sleep
  (:class:`Hold`, ``--forward-ms``, ``--backward-ms``, split over a stage's ``v``
  chunks) on an activation of ``--hold-width`` numbers per token: the stages need no
  core, so p = 4 runs on 2 cores and the bubble measured is the executed schedule's and
  the engine's (its message order and latency, Python overhead), not the CPU's. What it
  does not show: the imbalance of real stages and contention for memory bandwidth.

Not part of CI. Run from the repository root::

    mpiexec -n 2 .venv/bin/python benchmarks/pipeline_bubble.py
    mpiexec --oversubscribe -n 4 .venv/bin/python benchmarks/pipeline_bubble.py --compute hold
    .venv/bin/python benchmarks/pipeline_bubble.py --compute hold --thread-ranks 4

Measured on a quiet 2-core machine (benchmarks/README.md, 2026-12-02): held stages
1.00-1.04x the formula at p = 4 on MPI ranks, 1.02-1.08x on thread ranks; real stages
at p = 2 1.07-1.52x, the excess their measured imbalance.

On MPI a rank waiting for a message spins (Open MPI polls; oversubscribed it yields
between polls), so p = 4 held ranks on 2 cores still share the cores while waiting;
``--thread-ranks`` runs the stages as threads of one process, whose waits block, the
engine the same (its schedule, messages and wrapper) over the thread communicator.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mpidl import functions as F  # noqa: E402
from mpidl.autograd import Function, Tensor  # noqa: E402
from mpidl.backend import keep_freed_memory  # noqa: E402
from mpidl.comm import world  # noqa: E402
from mpidl.nn.module import Module, Parameter  # noqa: E402
from mpidl.parallel import PipelineModel, ProcessGrid, pipeline_gpt  # noqa: E402


class Hold(Function):
    """The identity, whose forward sleeps ``forward_s`` and backward ``backward_s``:
    a stage's compute as a wait of known length that needs no core."""

    def forward(self, x: Any) -> Any:
        time.sleep(self.forward_s)
        return x.copy()

    def backward(self, gy: Any) -> Any:
        time.sleep(self.backward_s)
        return gy


class HoldPart(Module):
    """A pipeline part (:class:`mpidl.parallel.pipeline.Part`) whose work is :class:`Hold`:
    part 0 makes a ``(b, T, width)`` activation from its one weight, each part adds its
    weight and holds, the last part returns the sum as its loss."""

    dtype = numpy.dtype(numpy.float32)
    tied_out = tied_in = None

    def __init__(self, index: int, parts: int, forward_s: float, backward_s: float,
                 width: int = 1) -> None:
        super().__init__()
        self.width = width
        self.index, self.first, self.last = index, index == 0, index == parts - 1
        self.forward_s, self.backward_s = forward_s, backward_s
        self.w = Parameter(numpy.ones(1, dtype=self.dtype))

    def forward(self, x: Tensor | None, ids: Any) -> Tensor:
        if x is None:
            x = Tensor(numpy.zeros(self.input_shape(ids), dtype=self.dtype))
        y = Hold.apply(F.add(x, self.w), forward_s=self.forward_s, backward_s=self.backward_s)
        return F.sum(y) if self.last else y

    def input_shape(self, ids: Any) -> tuple[int, ...]:
        return (ids.shape[0], ids.shape[1] - 1, self.width)

    def count_targets(self, ids: Any) -> int:
        return int(ids.shape[0] * (ids.shape[1] - 1))

    def full_names(self) -> dict[str, str]:
        return {"w": f"parts.{self.index}.w"}


def build(grid: ProcessGrid, schedule: str, m: int, v: int,
          args: argparse.Namespace) -> PipelineModel:
    """This rank's stage of a ``p v``-part model, real (GPT) or held. Collective."""
    p = grid.pipeline_size
    if args.compute == "real":
        return pipeline_gpt(grid, microbatches=m, schedule=schedule, virtual_stages=v,
                            vocab=args.vocab, seq_len=args.seq, dim=args.dim,
                            layers=args.blocks * p * v, heads=4, seed=0, tie_weights=False)
    # A stage's work per microbatch stays forward_ms + backward_ms however many chunks.
    parts = [HoldPart(k, p * v, args.forward_ms / 1e3 / v, args.backward_ms / 1e3 / v,
                      args.hold_width) for k in range(grid.pipeline_rank, p * v, p)]
    return PipelineModel(grid, parts, schedule=schedule, microbatches=m)


def measure(grid: ProcessGrid, schedule: str, m: int,
            args: argparse.Namespace) -> tuple[float, float, float]:
    """This rank's medians over ``args.steps`` steps of its bubble, the step's idle time
    over its busy time, of the engine's own ``wait / (step - wait)`` and of its busy
    seconds (the work: stages that differ in it wait for the slowest, beyond the formula).

    A step is timed from a barrier before :meth:`PipelineModel.step` to one after, as a
    training step ends in the optimizer's global clipping: so a rank's idle time is the
    step's wall time less its work (``step_seconds - wait_seconds``), including the wait
    after its own last backward for the other stages to finish. The engine's ratio
    leaves that out (its step ends with its own last action) and counts from the rank's
    own start, so it differs by rank (GPipe's stage ``r`` finishes ``r`` backwards early).
    """
    v = args.virtual if schedule == "interleaved" else 1
    model = build(grid, schedule, m, v, args)
    rng = numpy.random.default_rng(0)
    bubbles, engine, work = [], [], []
    for step in range(args.steps + 1):
        ids = rng.integers(0, args.vocab, size=(m * args.rows, args.seq + 1))
        grid.world.barrier()
        start = time.perf_counter()
        model.step(ids)
        grid.world.barrier()
        wall = time.perf_counter() - start
        for param in model.parameters():
            param.grad = None
        if step:  # the first step warms up
            busy = model.step_seconds - model.wait_seconds
            bubbles.append((wall - busy) / busy)
            engine.append(model.wait_seconds / busy)
            work.append(busy)
    model.close()
    return statistics.median(bubbles), statistics.median(engine), statistics.median(work)


def formula(p: int, m: int, v: int) -> float:
    """The schedule's idle over busy time per stage: ``(p - 1) / (v m)``."""
    return (p - 1) / (v * m)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compute", choices=("real", "hold"), default="real")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--virtual", type=int, default=2, help="chunks per stage, interleaved")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per part (real)")
    parser.add_argument("--dim", type=int, default=128, help="model width (real)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2, help="rows per microbatch")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--forward-ms", type=float, default=10.0,
                        help="a stage's forward of one microbatch (hold)")
    parser.add_argument("--backward-ms", type=float, default=20.0,
                        help="a stage's backward of one microbatch (hold)")
    parser.add_argument("--hold-width", type=int, default=1,
                        help="activation width (hold): 1 sends T floats a row; --dim's "
                             "width sends what the real model sends")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--thread-ranks", type=int, metavar="P", default=0,
                        help="hold only: P stages as threads of one process (waits block "
                             "without spinning) instead of the MPI world")
    args = parser.parse_args(argv)
    if args.thread_ranks and args.compute != "hold":
        parser.error("--thread-ranks needs --compute hold: real compute in threads "
                     "measures the GIL, not the schedule")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keep_freed_memory()  # as mpidl train does (its keep_freed_memory key)
    if args.thread_ranks:
        from mpidl.testing import run_ranks

        run_ranks(args.thread_ranks, report, args, timeout=600.0)
    else:
        report(world(), args)


def report(comm: Any, args: argparse.Namespace) -> None:
    """Measure every schedule and microbatch count; rank 0 prints the table. Collective."""
    grid = ProcessGrid(comm, pipeline=comm.size)
    p = comm.size
    if comm.rank == 0:
        what = (f"{args.blocks} float32 blocks of d={args.dim} per part, T={args.seq}, "
                f"{args.rows} rows per microbatch" if args.compute == "real" else
                f"held compute: forward {args.forward_ms:g} ms, backward "
                f"{args.backward_ms:g} ms per stage and microbatch")
        ranks = f"{p} thread ranks" if args.thread_ranks else f"{p} MPI ranks"
        print(f"p={p} stages ({ranks}); {what}; bubble = idle / busy time of a step "
              f"between barriers, median of {args.steps} steps; ranks' mean, min-max; "
              f"engine: its wait / (step - wait) by rank; imbalance: the most busy time of "
              f"a rank over the least")
        print(f"{'schedule':<15} {'m':>3} {'measured':>9} {'formula':>8} {'ratio':>6}  "
              f"{'ranks':<11}  {'engine':<11}  {'imbalance':>9}")
    for schedule in args.schedules:
        for m in args.microbatches:
            v = args.virtual if schedule == "interleaved" else 1
            if m < p or (schedule == "interleaved" and m % p):
                continue
            everyone = comm.allgather_obj(measure(grid, schedule, m, args))
            if comm.rank == 0:
                ideal = formula(p, m, v)
                step, engine, work = ([e[i] for e in everyone] for i in (0, 1, 2))
                print(f"{schedule + (f' v={v}' if v > 1 else ''):<15} {m:>3} "
                      f"{statistics.mean(step):>9.3f} {ideal:>8.3f} "
                      f"{statistics.mean(step) / ideal:>6.2f}  "
                      f"{min(step):.3f}-{max(step):.3f}  {min(engine):.3f}-{max(engine):.3f}"
                      f"{max(work) / min(work):>9.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
