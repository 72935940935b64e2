"""The build-time memory peak of a pipeline stage: the whole model cut, or the stage alone.

Each rank of ``mpiexec -n p`` builds a ``p``-stage pipeline of one gpt two ways, each in
a process of its own (the peak resident set is per process): ``whole`` builds the full
model from the seed and cuts its stage (``pipeline_model(gpt(...))``, what every rank did
before #26's per-stage build), ``stage`` builds its stage's layers only
(``pipeline_gpt``: ``GPT(keep=...)``, the same values). Printed per rank: the peak
resident set (``ru_maxrss``) of the process, the bytes of the parameters it keeps, and
the build's seconds. Not part of CI. From the repository root::

    mpiexec -n 2 .venv/bin/python benchmarks/stage_build.py --mode whole
    mpiexec -n 2 .venv/bin/python benchmarks/stage_build.py --mode stage
    mpiexec -n 2 .venv/bin/python benchmarks/stage_build.py --mode stage --dim 1536 --layers 24
"""
from __future__ import annotations

import argparse
import resource
import time

from mpidl.comm import world
from mpidl.models import gpt
from mpidl.parallel import ProcessGrid
from mpidl.parallel.pipeline_gpt import pipeline_gpt, pipeline_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("whole", "stage"), required=True)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    comm = world()
    grid = ProcessGrid(comm, pipeline=comm.size)
    shape = dict(vocab=args.vocab, seq_len=args.seq, dim=args.dim, layers=args.layers,
                 heads=max(args.dim // 64, 1), seed=0)
    start = time.perf_counter()
    if args.mode == "whole":
        model = pipeline_model(gpt(**shape), grid, microbatches=comm.size)
    else:
        model = pipeline_gpt(grid, microbatches=comm.size, **shape)
    seconds = time.perf_counter() - start
    kept = sum(p.data.nbytes for p in model.module.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    for rank, (p, k, s) in enumerate(comm.allgather_obj((peak, kept, seconds))):
        if comm.rank == 0:
            print(f"{args.mode}: rank {rank} peak RSS {p / 2**30:.2f} GiB, parameters "
                  f"kept {k / 2**30:.2f} GiB, build {s:.1f} s", flush=True)
    grid.free()


if __name__ == "__main__":
    main()
