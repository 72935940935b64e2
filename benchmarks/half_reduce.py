"""Gradient reduction of mixed precision: fp32 buckets against 16-bit ones (#26).

Half parameters' gradients can be reduced in two ways: kept in fp32 buckets and summed
by MPI's own float32 allreduce (what mpidl does, Megatron's bf16 default), or sent in
16 bits, which MPI cannot add (no bfloat16 type; float16 not in every library), so a
user-defined op widens, adds and rounds (mpidl.parallel.compression, what
``compression="bfloat16"`` does). This times one allreduce of ``--mb`` MiB of fp32
gradients each way, in DataParallel's 4 MiB pieces: the minimum over ``--repeat`` calls
per case, cases alternating. Run from the repository root::

    mpiexec -n 2 .venv/bin/python benchmarks/half_reduce.py
    mpiexec -n 2 .venv/bin/python benchmarks/half_reduce.py --mb 64 --repeat 20
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpidl.comm import world  # noqa: E402
from mpidl.parallel.transport import CompressedTransport, MpiTransport  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=float, default=16.0, help="fp32 gradient MiB")
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    comm = world()
    piece = 4 << 20
    cases = {"fp32 allreduce": MpiTransport(comm, piece),
             "float16 wire, user op": CompressedTransport(comm, piece, "float16"),
             "bfloat16 wire, user op": CompressedTransport(comm, piece, "bfloat16")}
    grad = numpy.random.default_rng(comm.rank).standard_normal(
        int(args.mb * 2**20) // 4).astype(numpy.float32)
    best = {name: float("inf") for name in cases}
    for _ in range(args.repeat):
        for name, transport in cases.items():
            flat = grad.copy()
            comm.barrier()
            t0 = time.perf_counter()
            transport.allreduce_(flat)
            best[name] = min(best[name], max(comm.allgather_obj(time.perf_counter() - t0)))
    if comm.rank == 0:
        print(f"{comm.size} ranks, {args.mb:g} MiB of fp32 gradients, minimum of {args.repeat}")
        for name, t in best.items():
            print(f"  {name:24s} {1e3 * t:8.2f} ms  {args.mb / 1024 / t:6.2f} GiB/s of fp32")


if __name__ == "__main__":
    main()
