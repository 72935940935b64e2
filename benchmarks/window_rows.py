"""Where summing an embedding table's gradient by its touched rows beats summing it whole.

On one node DataParallel keeps the tables' gradients in the shared window
(:mod:`mpidl.comm.shared`); the owner of each share of rows sums either the whole share
(streamed, ``mine += other``) or only the rows some rank marked (``take``, add, fancy
write back). This times both on the bow table (20000 x 128 float32 by default) for a
range of touched fractions, each rank marking its own random rows, and reports the
fraction of the share's rows in the union where rows stop paying: the crossover that
``mpidl.comm.shared.DENSE_ROWS_ABOVE`` encodes. Run under a launcher::

    OMP_NUM_THREADS=1 .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/window_rows.py

Each sum starts from a freshly written table (as backward leaves it: every row written),
then a barrier; the time is the slowest rank's median over ``--reps`` sums, fences
included. One JSON line per fraction, then a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--fractions", default="0.01,0.05,0.1,0.2,0.3,0.4,0.5,0.7,1.0",
                   help="fraction of the rows each rank marks (random rows)")
    p.add_argument("--reps", type=int, default=60)
    args = p.parse_args(argv)
    from mpi4py import MPI

    import mpidl.comm
    import mpidl.comm.shared as shared

    comm = mpidl.comm.world()
    w = MPI.COMM_WORLD
    table = numpy.zeros(args.rows * args.width, numpy.float32)
    win = shared.NodeSharedArrays(comm, [table], rows=[args.rows])
    mine, mask = win.local[0].reshape(args.rows, args.width), win.masks[0]
    rng = numpy.random.default_rng(w.rank)
    fresh = rng.standard_normal(mine.shape).astype(numpy.float32)
    rows = []
    try:
        for frac in [float(f) for f in args.fractions.split(",")]:
            touched = rng.random(args.rows) < frac
            mask[...] = touched
            res = {}
            for how, threshold in (("whole", -1.0), ("rows", 2.0)):
                shared.DENSE_ROWS_ABOVE = threshold
                times = []
                for _ in range(args.reps):
                    numpy.multiply(fresh, touched[:, None], out=mine)  # zero where untouched
                    w.Barrier()
                    t0 = time.perf_counter()
                    win.allreduce_()
                    times.append(time.perf_counter() - t0)
                res[how] = w.allreduce(1e3 * statistics.median(times), op=MPI.MAX)
            union = numpy.zeros(args.rows, bool)
            for m in win.mask_copies[0]:
                union |= m
            rec = {"bench": "window_rows", "ranks": w.size, "rows": args.rows,
                   "width": args.width, "marked_per_rank": frac,
                   "union": float(union.mean()), "whole_ms": res["whole"],
                   "rows_ms": res["rows"],
                   "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
            rows.append(rec)
            if w.rank == 0:
                print(json.dumps(rec), flush=True)
    finally:
        win.free()
    if w.rank == 0:
        print(f"\n{w.size} ranks, a {args.rows} x {args.width} float32 table, median of "
              f"{args.reps} sums (slowest rank)")
        print("\n| rows marked per rank | union of the ranks' rows | whole share ms | "
              "by rows ms | rows / whole |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['marked_per_rank']:.2f} | {r['union']:.2f} | {r['whole_ms']:.3f} | "
                  f"{r['rows_ms']:.3f} | {r['rows_ms'] / r['whole_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
