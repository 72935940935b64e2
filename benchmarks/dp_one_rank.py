"""DataParallel's cost at one rank, and weak scaling at N, in one launch: the bare model
and the wrapped one step in alternating blocks.

``dp_train.py --frameworks mpidl,bare`` compares separate launches, and on a 2-vCPU
virtual machine two launches of the same bow step a minute apart differ by 10-30%
(benchmarks/README.md, #30's ratios): more than the 3% to be shown. Here both models
(the same architecture and seed, dp_train.py's batches, SGD, the heap policy mpidl train
sets) live in one process and take blocks of ``--block`` steps in turn, each block timed
with ``time.process_time`` (what the process computed, not what the machine lent it);
the ratio is bare / wrapped of the medians, per model.

Under ``mpiexec -n N`` every rank steps a bare model of its own (no communication: N
independent 1-rank trainings, each rank's core busy as in the N-rank run) and the
DataParallel one in turn, each block between barriers and timed by the wall clock (the
exchange's waits count): bare / wrapped is then the weak-scaling efficiency, N-rank
samples/s over N x 1-rank samples/s, from one launch. Not part of CI::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dp_one_rank.py --models bow,mlp,transformer,gpt
    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python benchmarks/dp_one_rank.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import dp_train  # noqa: E402

from mpidl.comm import world  # noqa: E402


def blocks(step, n: int, comm) -> float:
    """Seconds of ``n`` steps: CPU time at one rank, the slowest rank's wall time at N."""
    if comm.size == 1:
        start = time.process_time()
        for _ in range(n):
            step()
        return time.process_time() - start
    comm.barrier()
    start = time.perf_counter()
    for _ in range(n):
        step()
    comm.barrier()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="bow,mlp,transformer,gpt")
    p.add_argument("--block", type=int, default=20, help="steps a block")
    p.add_argument("--blocks", type=int, default=30, help="blocks of each, alternated")
    args = p.parse_args()
    comm = world()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    what = "CPU s" if comm.size == 1 else f"wall s, {comm.size} ranks"
    say(f"# {what}; the last column: DataParallel's speed over the bare model's"
        + ("" if comm.size == 1 else " (independent on every rank): weak-scaling efficiency"))
    say("| model | bare ms/step | DataParallel ms/step | DataParallel / bare (speed) | "
          "blocks |\n|---|---|---|---|---|", flush=True)
    for model in args.models.split(","):
        steps = {}
        for framework in ("bare", "mpidl"):
            options = argparse.Namespace(model=model, framework=framework, bucket_mb=None,
                                         malloc="own", overlap=None, no_sync=False,
                                         independent=True)
            batches = dp_train.make_batches(model, comm.rank, "zipf")
            steps[framework], _ = dp_train.mpidl_step(options, batches)
            blocks(steps[framework], args.block, comm)  # warm-up
        times: dict[str, list[float]] = {"bare": [], "mpidl": []}
        for i in range(args.blocks):
            order = ("bare", "mpidl") if i % 2 == 0 else ("mpidl", "bare")
            for framework in order:
                times[framework].append(blocks(steps[framework], args.block, comm) / args.block)
        bare, wrapped = (statistics.median(times[f]) for f in ("bare", "mpidl"))
        say(f"| {model} | {1e3 * bare:.3f} | {1e3 * wrapped:.3f} | {bare / wrapped:.3f} | "
              f"{args.blocks} x {args.block} |", flush=True)


if __name__ == "__main__":
    main()
