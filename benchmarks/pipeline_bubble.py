"""The measured bubble of the pipeline schedules (#26) against (p-1)/m and (p-1)/(v m).

Every rank is a stage (``ProcessGrid(world, pipeline=size)``), float32, one thread per
rank. Per schedule and microbatch count: a few training steps of a GPT whose stages
hold equal blocks; each rank's bubble is the time it waited for messages over the time
it did not, ``wait / (step - wait)`` (:attr:`PipelineModel.wait_seconds`), the median
over the steps; the table gives the ranks' mean beside the formula. The first and last
stages also hold the embedding and the head, so they are a little slower, and a shared
machine's noise adds waits: read the ratio, not the digits. Not part of CI. Run from
the repository root::

    mpiexec -n 2 .venv/bin/python benchmarks/pipeline_bubble.py
    mpiexec -n 4 .venv/bin/python benchmarks/pipeline_bubble.py --microbatches 4 8 16 \\
        --schedules 1f1b interleaved --dim 128 --steps 5
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import numpy  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mpidl.comm import world  # noqa: E402
from mpidl.parallel import ProcessGrid, pipeline_gpt  # noqa: E402


def measure(grid: ProcessGrid, schedule: str, m: int, args: argparse.Namespace) -> float:
    v = args.virtual if schedule == "interleaved" else 1
    p = grid.pipeline_size
    model = pipeline_gpt(grid, microbatches=m, schedule=schedule, virtual_stages=v,
                         vocab=args.vocab, seq_len=args.seq, dim=args.dim,
                         layers=args.blocks * p * v, heads=4, seed=0, tie_weights=False)
    rng = numpy.random.default_rng(0)
    bubbles = []
    for step in range(args.steps + 1):
        ids = rng.integers(0, args.vocab, size=(m * args.rows, args.seq + 1))
        model.step(ids)
        for param in model.parameters():
            param.grad = None
        if step:  # the first step warms up
            busy = model.step_seconds - model.wait_seconds
            bubbles.append(model.wait_seconds / busy)
    return statistics.median(bubbles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--virtual", type=int, default=2, help="chunks per stage, interleaved")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per part")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2, help="rows per microbatch")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    comm = world()
    grid = ProcessGrid(comm, pipeline=comm.size)
    p = comm.size
    if comm.rank == 0:
        print(f"p={p} stages, {args.blocks} blocks of d={args.dim}, T={args.seq} per part, "
              f"{args.rows} rows per microbatch; bubble = wait / (step - wait), ranks' mean")
        print(f"{'schedule':<12} {'m':>3} {'measured':>9} {'formula':>8}")
    for schedule in args.schedules:
        for m in args.microbatches:
            v = args.virtual if schedule == "interleaved" else 1
            if m < p or (schedule == "interleaved" and m % p):
                continue
            mine = measure(grid, schedule, m, args)
            everyone = comm.allgather_obj(mine)
            if comm.rank == 0:
                print(f"{schedule:<12} {m:>3} {statistics.mean(everyone):>9.3f} "
                      f"{(p - 1) / (v * m):>8.3f}", flush=True)


if __name__ == "__main__":
    main()
