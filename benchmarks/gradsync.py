"""Gradient synchronisation alone: mpidl's buckets vs per-parameter vs one raw Allreduce.

For each reference model's gradient set (float32, every parameter, the embedding tables
as dense gradients so all three move the same bytes), at 2 ranks by default:

- ``raw``: one mpi4py ``Allreduce(IN_PLACE)`` of a single buffer holding all gradient
  bytes, the ceiling (no Python per parameter, no buckets);
- ``per_param``: one blocking ``comm.allreduce_(p.grad)`` per parameter, in backward's
  order (what a naive data-parallel loop does);
- ``bucketed B``: what :class:`mpidl.parallel.DataParallel` does after backward with
  ``bucket_mb=B`` for buckets not started during backward: on one node, the sum of the
  buckets in their shared-memory window (:mod:`mpidl.comm.shared`), else one blocking
  allreduce per bucket, in order;
- ``bucketed-allreduce B``: ``DataParallel(shared_memory=False)``: one blocking MPI
  allreduce per bucket, in order (the multi-node path, measured on one node);
- ``bucketed-nb B``: every bucket's non-blocking allreduce started in order, then
  waited for (what backward does when it starts them all from its hooks).

Every sync starts from gradients just written by this rank (the same values rewritten
before each call, outside the timed time, then a barrier), as backward leaves them: a
sync of buffers that the previous sync left in the caches is faster than training ever
sees, and on this VM it flips between two speeds from one run to the next. ``--hot``
times back-to-back syncs of the same buffers instead. ``--then-read`` adds one read of
every gradient to each timed sync (the optimizer's next pass): the shared-memory sum
leaves each share in the cache of the core that summed it, MPI in the caller's.

Throughput is gradient bytes / time (the slowest rank's, per window). Each round
measures every case once, cases alternating, and windows are pooled over rounds. On a
shared machine the median moves with other tenants' load (a spin-waiting MPI rank that
loses its core stalls its peer), so the table gives each case's **minimum** (the least
disturbed window: short windows, many of them) and median, and the ratios to ``raw``
and ``per_param`` for both, measured in the same run.

Run from the repository root (it launches ``mpiexec`` itself)::

    .venv/bin/python benchmarks/gradsync.py                       # 2 ranks, all models
    .venv/bin/python benchmarks/gradsync.py --rounds 3 --bucket-mb 0.25,1,4,16,25
    .venv/bin/python benchmarks/gradsync.py --mca coll_tuned_use_dynamic_rules=1 \\
        --mca coll_tuned_allreduce_algorithm=4          # force Open MPI's ring allreduce

Prints one JSON line per measurement, then a markdown table.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import subprocess  # noqa: E402
from typing import Any, Callable  # noqa: E402

import mpi_timing as mt  # noqa: E402

MODELS = ("mlp", "bow", "transformer")


Case = tuple[list[Any], Callable[[], None]]  # the gradient arrays it syncs, the sync


def _refill(arrays: list[Any]) -> Callable[[], None]:
    """Rewrites ``arrays`` with their present values, as backward writes fresh gradients."""
    sources = [a.copy() for a in arrays]

    def refill() -> None:
        for a, src in zip(arrays, sources):
            a[...] = src
    return refill


def _then_read(sync: Callable[[], None], arrays: list[Any]) -> Callable[[], None]:
    """``sync``, then one pass reading every gradient, as the optimizer's step does next."""
    def step() -> None:
        sync()
        for a in arrays:
            a.max()
    return step


def cases(model_name: str, bucket_mbs: list[float], comm: Any,
          args_nonblocking: bool = True) -> dict[str, Case]:
    """``(arrays, sync)`` of each case, on a model whose gradients hold random values."""
    import numpy as np
    from mpi4py import MPI

    import mpidl.models as models
    from mpidl.parallel.data import DataParallel

    rng = np.random.default_rng(comm.rank)
    out: dict[str, Case] = {}

    model = models.build(model_name, seed=0)
    params = model.parameters()
    total = sum(p.data.size for p in params)
    flat = rng.standard_normal(total).astype(np.float32)
    out["raw"] = ([flat],
                  lambda: comm.mpi_comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM))

    for p in params:
        p.grad = rng.standard_normal(p.data.shape).astype(p.data.dtype)
    backward_order = params[::-1]

    def per_param() -> None:
        for p in backward_order:
            comm.allreduce_(p.grad)
    out["per_param"] = ([p.grad for p in params], per_param)

    for mb in bucket_mbs:
        dps = {}
        for name, shared in (("bucketed", None), ("bucketed-allreduce", False)):
            m = models.build(model_name, seed=0)
            dps[name] = DataParallel(m, comm, bucket_mb=mb, sparse_embeddings=False,
                                     broadcast=False, shared_memory=shared)
            for b in dps[name].buckets:
                b.flat[...] = rng.standard_normal(b.flat.size)
        dp = dps["bucketed-allreduce"]

        def bucketed(dp: Any) -> None:
            # DataParallel.backward's sync when no bucket was started during backward.
            dp.launcher.next = 0
            dp.launcher.finish()

        def nonblocking(dp: Any = dp) -> None:
            # Every bucket started as during backward (overlap), then waited for.
            for b in dp.buckets:
                dp.launcher.start(b)
            for b in dp.buckets:
                dp.launcher.wait(b)
        for name, each in dps.items():
            out[f"{name} {mb:g}"] = ([b.flat for b in each.buckets],
                                     lambda each=each: bucketed(each))
        if args_nonblocking:
            out[f"bucketed-nb {mb:g}"] = ([b.flat for b in dp.buckets], nonblocking)
    return out


def worker(args: argparse.Namespace) -> int:
    mt.limit_threads()
    import mpidl.comm
    import mpidl.models as models

    comm = mpidl.comm.world()
    rank0 = comm.rank == 0
    info = mt.machine() if rank0 else {}
    results: dict[tuple[str, str], dict] = {}
    bucket_mbs = [float(v) for v in args.bucket_mb.split(",")]
    for model in args.models.split(","):
        steps = cases(model, bucket_mbs, comm)
        params = models.build(model, seed=0).parameters()
        nbytes, nparams = sum(p.data.nbytes for p in params), len(params)
        for r in range(args.rounds):
            names = list(steps) if r % 2 == 0 else list(steps)[::-1]
            for name in names:
                arrays, sync = steps[name]
                if args.then_read:
                    sync = _then_read(sync, arrays)
                times = mt.timed_windows(comm.mpi_comm, sync, args.window_s, args.windows,
                                         args.warmup_s,
                                         prepare=None if args.hot else _refill(arrays))
                rec = results.setdefault((model, name), {
                    "bench": "gradsync", "model": model, "case": name, "world": comm.size,
                    "grad_bytes": nbytes, "params": nparams, "mca": args.mca_note,
                    "gradients": "hot" if args.hot else "fresh", "then_read": args.then_read,
                    "times": []})
                rec["times"] += times
    if not rank0:
        return 0
    for rec in results.values():
        t = rec.pop("times")
        rec["ms"] = mt.stats([1e3 * v for v in t])
        rec["gb_per_s"] = rec["grad_bytes"] / 1e9 / (rec["ms"]["median"] / 1e3)
        rec["machine"] = info
        mt.emit(rec)
    print(f"\n{comm.size} ranks, load average {info.get('loadavg', 0):.2f}, "
          f"CPU idle before {info.get('cpu_idle_frac_pre', 0):.2f}"
          + (f", MCA {args.mca_note}" if args.mca_note else ""))
    print("\n| model | grad MB | params | case | ms min | ms median (max) | GB/s (min) "
          "| vs raw, min (median) | per_param / case, min (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (model, name), rec in results.items():
        raw, pp, ms = (results[(model, "raw")]["ms"], results[(model, "per_param")]["ms"],
                       rec["ms"])
        print(f"| {model} | {rec['grad_bytes'] / 1e6:.1f} | {rec['params']} | {name} | "
              f"{ms['min']:.2f} | {ms['median']:.2f} ({ms['max']:.2f}) | "
              f"{rec['grad_bytes'] / 1e6 / ms['min']:.2f} | "
              f"{raw['min'] / ms['min']:.2f}x ({raw['median'] / ms['median']:.2f}x) | "
              f"{pp['min'] / ms['min']:.2f}x ({pp['median'] / ms['median']:.2f}x) |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--bucket-mb", default="0.25,1,4,16,25", help="comma-separated MiB")
    p.add_argument("-n", "--ranks", type=int, default=2)
    p.add_argument("--window-s", type=float, default=0.1)
    p.add_argument("--windows", type=int, default=15)
    p.add_argument("--warmup-s", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mca", action="append", default=[],
                   help="KEY=VALUE passed to mpiexec as --mca KEY VALUE (repeatable)")
    p.add_argument("--hot", action="store_true",
                   help="sync the same buffers back to back (cache-hot, no rewrite between)")
    p.add_argument("--then-read", action="store_true",
                   help="time each sync with one read of every gradient after it (the "
                        "optimizer's next pass), wherever the sync left the result")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mca-note", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(args.ranks),
           "--oversubscribe"]
    for kv in args.mca:
        key, _, value = kv.partition("=")
        cmd += ["--mca", key, value]
    cmd += [sys.executable, os.path.abspath(__file__), "--worker",
            "--models", args.models, "--bucket-mb", args.bucket_mb,
            "--window-s", str(args.window_s), "--windows", str(args.windows),
            "--warmup-s", str(args.warmup_s), "--rounds", str(args.rounds),
            "--mca-note", " ".join(args.mca)] + (["--hot"] if args.hot else []) \
        + (["--then-read"] if args.then_read else [])
    env = dict(os.environ, **mt.MPI_ENV, MPIDL_COMM="mpi",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("# " + " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
