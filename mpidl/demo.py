"""``mpidl demo``: a short tour of the communicator on every rank of the job.

Run::

    mpiexec -n 2 mpidl demo

Each rank contributes its rank number; rank 0 prints what the collectives returned and
the bandwidth of a few allreduces, so a user sees at once whether the ranks form one
communicator (a launcher mismatch gives several worlds of size 1).
"""
from __future__ import annotations

import argparse
import socket
import time
from typing import Sequence

import numpy


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="mpidl demo", description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=4.0,
                        help="size of the allreduce whose bandwidth is measured (default 4)")
    args = parser.parse_args(list(argv))

    from mpidl.comm import world

    comm = world()
    ranks = comm.allreduce_(numpy.array([comm.rank], dtype=numpy.int64))
    hosts = comm.allgather_obj(socket.gethostname())
    comm.check(int(ranks[0]) == comm.size * (comm.size - 1) // 2,
               f"allreduce of ranks gave {int(ranks[0])}")

    x = numpy.ones(max(1, int(args.megabytes * 2**20 / 4)), dtype=numpy.float32)
    comm.allreduce_(x)  # warm-up: connections are set up lazily
    reps = 5
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        comm.allreduce_(x)
    seconds = comm.allreduce_(numpy.array([time.perf_counter() - t0]), op="max")[0] / reps

    if comm.rank == 0:
        nodes = sorted(set(hosts))
        print(f"ranks: {comm.size}")
        print(f"nodes: {len(nodes)} ({', '.join(nodes)})")
        expected = comm.size * (comm.size - 1) // 2
        print(f"allreduce of rank ids: {int(ranks[0])} (expected {expected})")
        mb = x.nbytes / 2**20
        print(f"allreduce of {mb:.1f} MiB float32: {seconds * 1e3:.2f} ms "
              f"({x.nbytes / seconds / 1e9:.2f} GB/s algorithm bandwidth)")
    return 0
