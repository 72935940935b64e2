"""Where a data-parallel step goes, phase by phase, and three other ways to sync it.

Runs under a launcher (2 ranks, 1 thread each)::

    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python benchmarks/dp_phases.py
    OMP_NUM_THREADS=1 mpiexec -n 1 .venv/bin/python benchmarks/dp_phases.py   # the 1-rank step
    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python benchmarks/dp_phases.py --model transformer \
        --variants dataparallel,allreduce --steps 40 --warmup 5

Each step of a reference model (the mlp by default; dp_train.py's batches, SGD,
``DataParallel`` defaults, freed memory kept) is timed in five phases: forward + backward
without the exchange (``no_sync``), a barrier (the ranks' skew), the dense gradient
exchange, the sparse exchange of embedding rows (none in the mlp), and the optimizer
step with ``zero_grad``, each as wall time and as the thread's CPU time (on a shared machine the
CPU time shows the work, the wall time also the waits), per rank. The exchange is one
of (``--variants``):

- ``dataparallel``: what ``DataParallel.backward`` does (on one node: the buckets and the
  embedding tables' gradients live in an MPI-3 shared-memory window and each rank sums
  its share of them straight out of the other ranks' copies, :mod:`mpidl.comm.shared`;
  the tables by their touched rows, in the "sync" phase, so "sparse" is then zero);
- ``allreduce``: ``DataParallel(shared_memory=False)``: one blocking MPI Allreduce per bucket;
- ``ring``: a hand-written ring allreduce (reduce-scatter, then allgather) over ``Sendrecv``;
- ``zero1``: ZeRO stage 1 as a prototype: the ring's reduce-scatter, each rank's SGD
  update of its own share of the parameters, then the ring's allgather of the updated
  parameters (here into a flat copy: the prototype does not rewire the model's arrays,
  so its model stops training; the time per step is what it measures). Its optimizer
  phase is only ``zero_grad``: the update is part of the exchange.
- ``window-zero1``: ZeRO stage 1 within the node's shared window, as a prototype: each rank
  sums its share of the gradients out of all copies (as ``dataparallel``), applies SGD
  to its share of a flat copy of the parameters kept in a second window, and writes the
  updated share into every rank's copy; no summed gradient is written back and each
  rank's optimizer pass covers 1/N of the parameters. Measures what moving the update
  into the exchange would save on one node (mlp only, like ``zero1``).

Median milliseconds per phase over the timed steps, the slowest rank's. Prototypes, not
library code: they show where a step's time goes and what another exchange would save
(benchmarks/README.md, "Third session" and "Fourth session").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402

PHASES = ("compute", "skew", "sync", "sparse", "opt", "step")


def _bounds(size: int, parts: int) -> list[tuple[int, int]]:
    step = -(-size // parts)
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(parts)]


def ring_reduce_scatter(w, flat, tmp) -> int:
    """Sum ``flat`` over the ranks, leaving the full sum of one share here: its index."""
    n, r = w.size, w.rank
    bd = _bounds(flat.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        (a, b), (c, d) = bd[(r - s) % n], bd[(r - s - 1) % n]
        w.Sendrecv(flat[a:b], right, 0, tmp[:d - c], left, 0)
        flat[c:d] += tmp[:d - c]
    return (r + 1) % n


def ring_allgather(w, flat, own: int) -> None:
    """Every rank's share ``own`` of ``flat`` (the full sum) to every rank."""
    n, r = w.size, w.rank
    bd = _bounds(flat.size, n)
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        (a, b), (c, d) = bd[(own - s) % n], bd[(own - s - 1) % n]
        w.Sendrecv(flat[a:b], right, 1, flat[c:d], left, 1)


def sgd_into(param, grad, scratch, lr: float) -> None:
    """``param -= lr * grad`` through ``scratch`` a piece at a time (no temporary array)."""
    for a in range(0, grad.size, scratch.size):
        e = min(grad.size, a + scratch.size)
        numpy.multiply(grad[a:e], -lr, out=scratch[:e - a])
        param[a:e] += scratch[:e - a]


def window_zero1_step(grads: Any, params: Any, scratch: Any, lr: float) -> None:
    """ZeRO-1 within the node's windows: each rank sums its share of every gradient
    bucket out of all copies (as ``NodeSharedArrays.allreduce_``), applies SGD to its
    share of the parameters, and writes the updated share into every rank's parameter
    copy; nobody writes the summed gradient back, and each rank's optimizer pass covers
    1/N of the parameters."""
    r = grads.rank
    grads._fence()
    params.win.Sync()
    for copies, pcopies in zip(grads.copies, params.copies):
        s = grads._share(copies[r].size, r)
        mine, pmine = copies[r][s], pcopies[r][s]
        for q, other in enumerate(copies):
            if q != r:
                mine += other[s]
        sgd_into(pmine, mine, scratch, lr)
        for q, other in enumerate(pcopies):
            if q != r:
                other[s] = pmine
    params._fence()


def run(variant: str, steps: int, warmup: int, model: str = "mlp") -> dict:
    from mpi4py import MPI

    import mpidl.comm
    import mpidl.models as models
    from mpidl.comm.shared import NodeSharedArrays
    from mpidl import functions as F
    from mpidl.optim import SGD
    from mpidl.parallel import DataParallel

    from dp_train import CASES, make_batches

    w = MPI.COMM_WORLD
    case = CASES[model]
    windowed_variant = variant in ("dataparallel", "window-zero1")
    dp = DataParallel(models.build(model, seed=0, **case.get("model", {})), mpidl.comm.world(),
                      keep_freed_memory=True,
                      shared_memory=None if windowed_variant else False)
    opt = SGD(dp.module.parameters(), lr=0.01)
    batches = make_batches(model, w.rank, "zipf")
    n = case["batch"] * w.size * (case["tokens"] - 1 if "model" in case else 1)
    classes = case.get("classes", 10)
    tmp = numpy.empty(max(b.flat.size for b in dp.buckets), numpy.float32)
    params = [numpy.zeros_like(b.flat) for b in dp.buckets]  # zero1's flat parameters
    scratch = numpy.empty(1 << 16, numpy.float32)
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    cpu: dict[str, list[float]] = {k: [] for k in PHASES}
    windowed = dp.transport.row_masks is not None
    if variant == "window-zero1" and w.size > 1 and not windowed:
        raise SystemExit("window-zero1 needs the buckets in a node-shared window (one node)")
    # window-zero1's parameters: flat copies in a second window (the prototype does not
    # rewire the model's arrays, as zero1); at 1 rank it is the plain step
    param_window = (NodeSharedArrays(mpidl.comm.world(), params)
                    if variant == "window-zero1" and windowed else None)
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = F.softmax_cross_entropy(dp(x).reshape(-1, classes), y.reshape(-1),
                                       reduction="sum")
        with dp.no_sync():
            dp.backward(loss, global_count=n)
        t1, c1 = time.perf_counter(), time.thread_time()
        w.Barrier()
        t2, c2 = time.perf_counter(), time.thread_time()
        if variant == "dataparallel" and windowed:
            dp.sync_gradients()  # the window sums buckets and tables in one go
        elif param_window is not None:
            window_zero1_step(dp.transport.window, param_window, scratch, lr=0.01)
        elif variant in ("dataparallel", "allreduce"):
            dp.launcher.finish()
        for k, b in enumerate(dp.buckets):
            if w.size == 1 or variant in ("dataparallel", "allreduce", "window-zero1"):
                break
            if variant == "ring":
                ring_allgather(w, b.flat, ring_reduce_scatter(w, b.flat, tmp))
            else:  # zero1: update this rank's share, then gather the parameters
                own = ring_reduce_scatter(w, b.flat, tmp)
                lo, hi = _bounds(b.flat.size, w.size)[own]
                sgd_into(params[k][lo:hi], b.flat[lo:hi], scratch, lr=0.01)
                ring_allgather(w, params[k], own)
        t3, c3 = time.perf_counter(), time.thread_time()
        if not (windowed_variant and windowed):
            # embedding rows (none in the mlp) by MPI, as DataParallel.backward
            dp.sparse_tables.sync(dp.comm, dp._piece_bytes)
        t3s, c3s = time.perf_counter(), time.thread_time()
        # zero1 and window-zero1 (at 2+ ranks) updated the parameters in the exchange
        if w.size == 1 or not (variant == "zero1" or param_window is not None):
            opt.step()
        opt.zero_grad()
        t4, c4 = time.perf_counter(), time.thread_time()
        if i >= warmup:
            for key, v, c in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3s - t3, t4 - t3s, t4 - t0),
                                 (c1 - c0, c2 - c1, c3 - c2, c3s - c3, c4 - c3s, c4 - c0)):
                times[key].append(1e3 * v)
                cpu[key].append(1e3 * c)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    if param_window is not None:
        param_window.free()
    return {"ms": {k: w.allreduce(v, op=MPI.MAX) for k, v in med.items()},
            "per_rank_ms": w.allgather(med), "per_rank_cpu_ms": w.allgather(med_cpu),
            "transport": dp.transport.name}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="dataparallel,allreduce,ring,zero1")
    p.add_argument("--model", default="mlp", help="mlp, bow, transformer or gpt (dp_train's "
                   "batches); ring, zero1 and window-zero1 are mlp only")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=100)
    args = p.parse_args(argv)
    from mpi4py import MPI

    rows = []
    for variant in [v for v in args.variants.split(",") if v]:
        if variant not in ("dataparallel", "allreduce", "ring", "zero1", "window-zero1"):
            raise SystemExit(f"unknown variant {variant!r}")
        if variant in ("ring", "zero1", "window-zero1") and args.model != "mlp":
            continue  # prototypes over the buckets only: no sparse rows, no other model
        res = run(variant, args.steps, args.warmup, args.model)
        rec = {"bench": "dp_phases", "model": args.model, "variant": variant,
               "ranks": MPI.COMM_WORLD.size, **res,
               "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
        rows.append(rec)
        if MPI.COMM_WORLD.rank == 0:
            print(json.dumps(rec), flush=True)
    if MPI.COMM_WORLD.rank == 0:
        print("\nwall ms (slowest rank's median), then each rank's wall / thread-CPU ms")
        print("\n| model | variant | ranks | rank | " + " | ".join(f"{k} ms" for k in PHASES)
              + " |")
        print("|---|---|---|---|" + "---|" * len(PHASES))
        for rec in rows:
            print(f"| {rec['model']} | {rec['variant']} | {rec['ranks']} | max | "
                  + " | ".join(f"{rec['ms'][k]:.2f}" for k in PHASES) + " |")
            for r, (wall, cpu) in enumerate(zip(rec["per_rank_ms"], rec["per_rank_cpu_ms"])):
                print(f"| | | | {r} | "
                      + " | ".join(f"{wall[k]:.2f} / {cpu[k]:.2f}" for k in PHASES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
