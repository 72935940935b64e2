"""Collective micro-benchmarks: latency, algorithm and bus bandwidth per message size.

OSU-style sweeps of MPI collectives over message sizes, with the NCCL-tests bandwidth
conventions, and an alpha-beta fit of the measured times. Run under a launcher; rank 0
prints, one table row (or one JSON line) per size::

    mpiexec -n 4 python -m hpc.bench                          # allreduce, 4 B .. 64 MiB
    mpiexec -n 4 python -m hpc.bench --op allreduce,allgather --max-bytes 1MiB --json
    srun --mpi=pmix python -m hpc.bench --device cupy         # CUDA-aware MPI, GPU buffers
    mpiexec -n 2 mpidl bench --op all --plot net.png --save-profile mycluster

Method: per size, ``--warmup`` iterations, then ``--windows`` timed windows of the
same iteration count on every rank, each after a barrier. A window's time is the
slowest rank's mean time per iteration; the reported time is the median over windows
(with min and max). Large messages run fewer iterations per window, so a window lasts
about ``--window-s``.

Bandwidths, in GB/s of 1e9 bytes: ``algbw = bytes / time``; ``busbw = algbw * factor``
with NCCL-tests' factors, which make busbw comparable with the link's bandwidth at any
rank count: allreduce ``2(n-1)/n``, allgather, reduce_scatter and alltoall
``(n-1)/n``, bcast and sendrecv 1. ``bytes`` is the allreduce/bcast buffer, the
allgather output, the reduce_scatter input and the alltoall send buffer (the whole
vector, NCCL-tests' convention), and the message each rank sends to the next in the
sendrecv ring exchange (rank r sends to r+1 and receives from r-1, as ring attention
passes its blocks).

The fit ``t(bytes) = alpha + bytes / beta`` (:func:`fit_alpha_beta`) gives the latency
alpha and the asymptotic bandwidth beta; ``--save-profile NAME`` stores each op's fit,
and the measured times it was fitted to (the planner interpolates them: one line fits
a shaped TCP link badly), as a network profile for ``mpidl plan`` (:mod:`hpc.costmodel`),
and ``--plot FILE`` draws time and bus bandwidth against message size (needs
matplotlib: the [plot] extra).

Needs mpi4py and NumPy (CuPy for ``--device cupy``); ``hpc`` never imports ``mpidl``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Sequence

import numpy as np

from hpc.argtypes import nonnegative_float, nonnegative_int, output_file, positive_int

OPS = ("allreduce", "allgather", "bcast", "reduce_scatter", "alltoall", "sendrecv", "iallreduce")
DTYPES = ("float32", "float64", "int32", "int64")
GB = 1e9
_UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2,
          "g": 1024**3, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}


def bus_factor(op: str, size: int) -> float:
    """busbw / algbw for ``op`` on ``size`` ranks (NCCL-tests, doc/PERFORMANCE.md): the
    cost model's :func:`hpc.costmodel.volume`. At one rank nothing crosses a link: the
    factor is 0 except for bcast and sendrecv."""
    from hpc.costmodel import volume

    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {', '.join(OPS)}")
    return volume(op, size)


def parse_bytes(text: str) -> int:
    """``"64"``, ``"64K"``/``"64KiB"`` (1024-based), ``"1MB"`` (1000-based) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a byte count; write e.g. 4096, 64KiB, 64K, 16MiB or 1MB")
    return int(m.group(1)) * _UNITS[unit]


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """``min_bytes * factor**k`` for every k with a result <= ``max_bytes``."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2; got "
                         f"min_bytes={min_bytes}, max_bytes={max_bytes}, factor={factor}")
    sizes, n = [], min_bytes
    while n <= max_bytes:
        sizes.append(n)
        n *= factor
    return sizes


@dataclass(frozen=True)
class AlphaBeta:
    """The cost model ``t(bytes) = alpha + bytes / beta``.

    Attributes:
        alpha: latency in seconds (>= 0).
        beta: bandwidth in bytes per second (> 0; ``inf`` when time does not grow).
    """

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        """Predicted seconds for one message of ``nbytes``."""
        return self.alpha + nbytes / self.beta


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of ``t = alpha + bytes / beta``, with ``alpha, 1/beta >= 0``.

    The residuals are relative (``(model - t) / t``): the sizes span seven decades, and
    absolute residuals would let the largest messages decide alone, fitting alpha to
    noise (often below zero). A coefficient that would come out negative is held at 0
    and the other refitted alone.

    Args:
        sizes: message sizes in bytes, at least two distinct.
        times: the measured seconds per message, all > 0.

    Raises:
        ValueError: lengths differ, fewer than two distinct sizes, or a time <= 0.
    """
    x = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if x.shape != t.shape or x.ndim != 1:
        raise ValueError(f"sizes and times must be 1-D of one length; got {x.shape} and "
                         f"{t.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError(f"an alpha-beta fit needs at least 2 distinct sizes; got "
                         f"{sorted(set(x.tolist()))}")
    if not np.all(t > 0) or not np.all(x >= 0):
        raise ValueError(f"times must be > 0 and sizes >= 0; got times {t.tolist()}")
    a = np.stack([1.0 / t, x / t], axis=1)  # rows scaled by 1/t: relative residuals
    ones = np.ones_like(t)

    def solve(columns: list[int]) -> tuple[np.ndarray, float]:
        coef = np.zeros(2)
        coef[columns] = np.linalg.lstsq(a[:, columns], ones, rcond=None)[0]
        return coef, float(np.sum((a @ coef - ones) ** 2))

    coef, _ = solve([0, 1])
    if coef[0] < 0 or coef[1] < 0:
        candidates = [c for c in (solve([0]), solve([1])) if np.all(c[0] >= 0)]
        coef = min(candidates, key=lambda c: c[1])[0]
    alpha, inv_beta = float(coef[0]), float(coef[1])
    return AlphaBeta(alpha, 1.0 / inv_beta if inv_beta > 0 else math.inf)


@dataclass
class Result:
    """One op at one size: per-window seconds per iteration, slowest rank's."""

    op: str
    nbytes: int
    elements: int  # per rank, in the send buffer (allgather) / receive buffer (r-s)
    dtype: str
    device: str
    ranks: int
    nodes: int
    iters: int
    windows: list[float]

    @property
    def seconds(self) -> float:
        return statistics.median(self.windows)

    @property
    def algbw(self) -> float:
        """Bytes per second."""
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.op, self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "bytes": self.nbytes, "elements": self.elements,
                "dtype": self.dtype, "device": self.device, "ranks": self.ranks,
                "nodes": self.nodes, "iters": self.iters, "windows": len(self.windows),
                "time_us": self.seconds * 1e6, "time_us_min": min(self.windows) * 1e6,
                "time_us_max": max(self.windows) * 1e6, "algbw_GBps": self.algbw / GB,
                "busbw_GBps": self.busbw / GB}


def _profile_name(text: str) -> str:
    """``--save-profile NAME``, checked before the sweep rather than after it."""
    from hpc import costmodel

    try:
        return costmodel.check_profile_name(text)
    except costmodel.ProfileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hpc.bench", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--op", default="allreduce",
                   help=f"comma-separated collectives: {', '.join(OPS)}, or 'all'")
    p.add_argument("--min-bytes", type=parse_bytes, default=4, help="smallest message")
    p.add_argument("--max-bytes", type=parse_bytes, default=64 * 1024**2,
                   help="largest message")
    p.add_argument("--factor", type=int, default=4, help="ratio of consecutive sizes")
    p.add_argument("--iters", type=positive_int, default=100,
                   help="iterations per timed window (fewer for large messages, see "
                        "--window-s)")
    p.add_argument("--warmup", type=nonnegative_int, default=10, help="untimed iterations per size")
    p.add_argument("--windows", type=positive_int, default=5, help="timed windows per size")
    p.add_argument("--window-s", type=nonnegative_float, default=0.25,
                   help="cap a window's iterations so it lasts about this long, judged "
                        "from the warm-up; 0: always --iters")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type")
    p.add_argument("--device", choices=("numpy", "cupy"), default="numpy",
                   help="where the buffers live; cupy measures CUDA-aware MPI")
    p.add_argument("--json", action="store_true",
                   help="one JSON line per size, then one per fit, instead of a table")
    p.add_argument("--plot", metavar="FILE", type=output_file, default=None,
                   help="draw time and bus bandwidth against message size into FILE (PNG)")
    p.add_argument("--save-profile", metavar="NAME", type=_profile_name, default=None,
                   help="store the fits as network profile NAME for `mpidl plan --network "
                        "NAME` (in $MPIDL_PROFILE_DIR or ~/.config/mpidl/network)")
    p.add_argument("--force", action="store_true",
                   help="write over an existing --plot file, and update an existing "
                        "--save-profile (its curves at other rank counts are kept)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; ``args.op`` becomes a list of op names."""
    p = build_parser()
    args = p.parse_args(argv)
    ops = OPS if args.op.strip() == "all" else [o.strip() for o in args.op.split(",")]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        p.error(f"--op {args.op!r}: unknown {unknown}; choose from {', '.join(OPS)} or all")
    args.op = list(dict.fromkeys(ops))
    for name, least in (("factor", 2), ("min_bytes", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= {least}")
    if args.max_bytes < args.min_bytes:
        p.error(f"--max-bytes {args.max_bytes} is below --min-bytes {args.min_bytes}")
    from hpc import costmodel
    from hpc.files import OutputError, check_output

    try:  # before the sweep, not after it
        if args.plot:
            check_output(args.plot, force=args.force)
        if args.save_profile:
            check_output(costmodel.network_profile_path(args.save_profile), force=args.force)
    except OutputError as e:
        p.error(str(e))
    # after the outputs' checks: a wrong input is told before a missing extra
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: install the [plot] extra (pip install 'mpidl[plot]')")
    return args


_WHOLE_VECTOR = ("allgather", "reduce_scatter", "alltoall")  # bytes: all ranks' blocks


def _elements(op: str, nbytes: int, itemsize: int, size: int) -> int:
    """Elements per rank for a message of about ``nbytes`` (see the module docstring)."""
    per = size if op in _WHOLE_VECTOR else 1
    return max(1, nbytes // (itemsize * per))


def _collective(op: str, comm: Any, MPI: Any, xp: ModuleType, dtype: str, count: int
                ) -> tuple[Callable[[], None], Callable[[], bool]]:
    """``(call, verify)``: one collective on fixed buffers, and a checked run of it.

    ``verify`` clears the output, runs the collective once more and checks the numbers
    on this rank, so a fast but wrong MPI path cannot report a bandwidth.
    """
    n, r = comm.Get_size(), comm.Get_rank()
    if op == "allreduce":
        send, recv = xp.ones(count, dtype), xp.zeros(count, dtype)
        call = lambda: comm.Allreduce(send, recv, op=MPI.SUM)  # noqa: E731
        out, want = recv, lambda: xp.full(count, n, dtype)
    elif op == "iallreduce":
        # What DataParallel's overlapped buckets run: MPI libraries implement the
        # non-blocking allreduce apart (Open MPI's libnbc, not its tuned Allreduce).
        send, recv = xp.ones(count, dtype), xp.zeros(count, dtype)
        call = lambda: comm.Iallreduce(send, recv, op=MPI.SUM).Wait()  # noqa: E731
        out, want = recv, lambda: xp.full(count, n, dtype)
    elif op == "allgather":
        send, recv = xp.full(count, r + 1, dtype), xp.zeros(n * count, dtype)
        call = lambda: comm.Allgather(send, recv)  # noqa: E731
        out, want = recv, lambda: xp.repeat(xp.arange(1, n + 1, dtype=dtype), count)
    elif op == "reduce_scatter":
        send, recv = xp.ones(n * count, dtype), xp.zeros(count, dtype)
        call = lambda: comm.Reduce_scatter_block(send, recv, op=MPI.SUM)  # noqa: E731
        out, want = recv, lambda: xp.full(count, n, dtype)
    elif op == "alltoall":
        # Block j of rank r holds r * n + j, so rank r receives i * n + r from rank i.
        send = xp.repeat(xp.arange(r * n, r * n + n, dtype=dtype), count)
        recv = xp.zeros(n * count, dtype)
        call = lambda: comm.Alltoall(send, recv)  # noqa: E731
        out, want = recv, lambda: xp.repeat(xp.arange(n, dtype=dtype) * n + r, count)
    elif op == "sendrecv":
        send, recv = xp.full(count, r + 1, dtype), xp.zeros(count, dtype)
        dest, source = (r + 1) % n, (r - 1) % n
        call = lambda: comm.Sendrecv(send, dest, recvbuf=recv, source=source)  # noqa: E731
        out, want = recv, lambda: xp.full(count, source + 1, dtype)
    else:
        buf = xp.full(count, 7 if r == 0 else 0, dtype)
        call = lambda: comm.Bcast(buf, root=0)  # noqa: E731
        out, want = buf, lambda: xp.full(count, 7, dtype)

    def verify() -> bool:
        if op != "bcast" or r != 0:  # the bcast root keeps its data: it is the input
            out[...] = 0
        _sync(xp)
        call()
        _sync(xp)
        return bool(xp.array_equal(out, want()))

    return call, verify


def _sync(xp: ModuleType) -> None:
    """Wait for the device's work: MPI reads device buffers outside CUDA's stream order."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def measure(comm: Any, MPI: Any, call: Callable[[], None], xp: ModuleType, iters: int,
            warmup: int, windows: int, window_s: float) -> tuple[int, list[float]]:
    """``(iterations per window, [slowest rank's seconds per iteration, per window])``.

    Collective: the iteration count comes from a MAX-allreduce of the warm-up time, so
    every rank calls ``call`` equally often.
    """
    t_iter, timed = 0.0, 0
    for i in range(warmup):
        if i == warmup // 2:  # time the second half: the first calls set up the path
            _sync(xp)
            t0, timed = time.perf_counter(), warmup - i
        call()
    _sync(xp)
    if timed:
        t_iter = comm.allreduce((time.perf_counter() - t0) / timed, op=MPI.MAX)
    count = iters
    if window_s > 0 and t_iter > 0:
        count = max(1, min(iters, math.ceil(window_s / t_iter)))
    per_window = []
    for _ in range(windows):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            call()
        _sync(xp)
        per_window.append(comm.allreduce((time.perf_counter() - t0) / count, op=MPI.MAX))
    return count, per_window


def _header(op: str, args: argparse.Namespace, ranks: int, nodes: int, library: str) -> str:
    factor = {"allreduce": "2(n-1)/n", "iallreduce": "2(n-1)/n", "bcast": "1",
              "sendrecv": "1"}.get(op, "(n-1)/n")
    return (f"# hpc.bench {op}: {ranks} ranks on {nodes} node(s), {args.dtype}, "
            f"{args.device} buffers; {library}\n"
            f"# time = slowest rank's mean per iteration, median (min-max) of "
            f"{args.windows} windows; busbw = algbw * {factor}\n"
            f"#{'bytes':>11} {'elements':>10} {'iters':>6} {'time(us)':>11} "
            f"{'min(us)':>11} {'max(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")


def _row(res: Result) -> str:
    us = [res.seconds * 1e6, min(res.windows) * 1e6, max(res.windows) * 1e6]
    return (f"{res.nbytes:12d} {res.elements:10d} {res.iters:6d} "
            + " ".join(f"{v:11.2f}" for v in us)
            + f" {res.algbw / GB:12.4g} {res.busbw / GB:12.4g}")


def _fit_record(op: str, results: list[Result]) -> dict[str, Any] | None:
    if len({r.nbytes for r in results}) < 2:
        return None
    fit = fit_alpha_beta([r.nbytes for r in results], [r.seconds for r in results])
    return {"op": op, "ranks": results[0].ranks, "nodes": results[0].nodes,
            "fit": "t = alpha + bytes / beta", "sizes": len(results),
            "alpha_us": fit.alpha * 1e6,
            "beta_GBps": None if math.isinf(fit.beta) else fit.beta / GB}


def _array_module(device: str) -> ModuleType:
    if device == "numpy":
        return np
    from hpc import gpu

    cp = gpu.cupy_module()
    if cp is None:
        raise SystemExit("hpc.bench --device cupy: CuPy does not import here; install the "
                         "[gpu] extra (e.g. pip install cupy-cuda12x) or use --device numpy")
    return cp


def _barrier_if_launched() -> None:
    """A barrier over MPI_COMM_WORLD when mpi4py is there and the job has several ranks."""
    from hpc import env

    if env.detect().size <= 1:
        return
    sys.stderr.flush()
    sys.stdout.flush()
    try:
        from mpi4py import MPI
    except ImportError:
        return
    MPI.COMM_WORLD.Barrier()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; the exit status is the same on every rank."""
    from hpc import env

    quiet = env.detect().rank != 0  # before MPI: argument errors print once, not n times
    try:
        with contextlib.ExitStack() as stack:
            if quiet:
                stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
                stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
            args = parse_args(argv)
    except SystemExit:
        # Every rank exits with argparse's status, but none before rank 0 has printed
        # the message: a silent rank exiting first makes the launcher kill rank 0
        # before it writes (seen as a lost error message under mpiexec).
        _barrier_if_launched()
        raise
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise SystemExit(f"hpc.bench needs mpi4py ({e}); install the [mpi] extra: "
                         f"pip install 'mpidl[mpi]'") from None
    comm = MPI.COMM_WORLD.Dup()
    library = env.library_name(MPI.Get_library_version())
    problem = env.world_mismatch(comm.Get_size(), library)
    if problem is not None:  # N size-1 worlds would each time a collective of one
        if not quiet:
            print(f"hpc.bench: error: {problem}", file=sys.stderr, flush=True)
        return 2
    where = env.from_mpi(comm)
    rank, ranks = comm.Get_rank(), comm.Get_size()
    xp = _array_module(args.device)
    if args.device == "cupy":
        from hpc import gpu

        gpu.bind(where.local_rank)
        verdict = gpu.cuda_aware_mpi(comm)
        if not verdict.aware:
            if rank == 0:
                print(f"hpc.bench: MPI is not CUDA-aware here ({verdict.reason}); "
                      f"--device cupy would hand it device pointers. Use --device numpy, "
                      f"or a CUDA-aware MPI (UCX with UCX_TLS including cuda_copy,"
                      f"cuda_ipc), or set MPIDL_CUDA_AWARE=1 to override.", file=sys.stderr)
            return 1
    library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0].strip()
    itemsize = np.dtype(args.dtype).itemsize
    say = print if rank == 0 else (lambda *a, **k: None)
    sweeps: dict[str, list[Result]] = {}
    for op in args.op:
        if not args.json:
            say(_header(op, args, ranks, where.nodes, library), flush=True)
        results: list[Result] = []
        seen: set[int] = set()
        for nbytes in message_sizes(args.min_bytes, args.max_bytes, args.factor):
            count = _elements(op, nbytes, itemsize, ranks)
            actual = count * itemsize * (ranks if op in _WHOLE_VECTOR else 1)
            if actual in seen:  # tiny sizes round to the same buffer at many ranks
                continue
            seen.add(actual)
            call, verify = _collective(op, comm, MPI, xp, args.dtype, count)
            iters, windows = measure(comm, MPI, call, xp, args.iters, args.warmup,
                                     args.windows, args.window_s)
            bad = comm.allgather(not verify())
            if any(bad):
                say(f"hpc.bench: {op} of {actual} bytes gave wrong numbers on ranks "
                    f"{[i for i, b in enumerate(bad) if b]}; the MPI library or its "
                    f"transport is broken for this size", file=sys.stderr, flush=True)
                return 1
            res = Result(op, actual, count, args.dtype, args.device, ranks, where.nodes,
                         iters, windows)
            results.append(res)
            say(json.dumps(res.to_json()) if args.json else _row(res), flush=True)
        sweeps[op] = results
        fit = _fit_record(op, results)
        if fit is not None:
            beta = "inf" if fit["beta_GBps"] is None else f"{fit['beta_GBps']:.4g} GB/s"
            say(json.dumps(fit) if args.json else
                f"# fit over {fit['sizes']} sizes, t = alpha + bytes / beta: "
                f"alpha = {fit['alpha_us']:.3g} us, beta = {beta}", flush=True)
    comm.Free()
    if rank == 0:
        return _outputs(args, sweeps, library)
    return 0


def _outputs(args: argparse.Namespace, sweeps: dict[str, list[Result]], library: str) -> int:
    """Rank 0: the plot and the saved profile asked for."""
    if args.plot:
        try:
            plot_sweeps(sweeps, args.plot)
        except ImportError as e:
            print(f"hpc.bench: --plot needs matplotlib ({e}); install the [plot] extra: "
                  "pip install 'mpidl[plot]'", file=sys.stderr)
            return 1
        print(f"# plot: {args.plot}")
    if args.save_profile:
        from hpc import costmodel

        fits = {op: fit_alpha_beta([r.nbytes for r in res], [r.seconds for r in res])
                for op, res in sweeps.items() if len({r.nbytes for r in res}) >= 2}
        first = next(iter(sweeps.values()))[0]
        path = costmodel.save_network_profile(
            args.save_profile, fits, ranks=first.ranks, nodes=first.nodes,
            curves={op: [(r.nbytes, r.seconds) for r in res] for op, res in sweeps.items()},
            source=f"measured with `mpidl bench` ({library}, {args.dtype}, {args.device} "
                   f"buffers, {first.ranks} ranks on {first.nodes} node(s)), "
                   f"{time.strftime('%Y-%m-%d %H:%M')}")
        at = sorted({r for link in costmodel.load_network(str(path)).links.values()
                     for r, _ in link.curves})
        print(f"# network profile {args.save_profile!r}: {path} (curves measured at "
              f"{', '.join(map(str, at)) or 'no'} rank counts)")
    return 0


def plot_sweeps(sweeps: dict[str, list[Result]], path: str) -> str:
    """Time and bus bandwidth against message size, one line per op, into ``path``."""
    # A Figure of its own, not pyplot: no process-wide backend or figure state changes.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    ax_t, ax_b = fig.subplots(1, 2)
    for op, results in sweeps.items():
        sizes = [r.nbytes for r in results]
        ax_t.loglog(sizes, [r.seconds * 1e6 for r in results], marker="o", ms=3, label=op)
        ax_b.semilogx(sizes, [r.busbw / GB for r in results], marker="o", ms=3, label=op)
    first = next(iter(sweeps.values()))[0]
    ax_t.set(xlabel="message size (bytes)", ylabel="time (us)",
             title=f"latency, {first.ranks} ranks on {first.nodes} node(s)")
    ax_b.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
             title="bus bandwidth (NCCL-tests convention)")
    for ax in (ax_t, ax_b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    sys.exit(main())
