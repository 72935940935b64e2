"""Input pipeline benchmarks: loader read throughput, and the input stall during training.

1. **Read throughput.** Every rank reads one epoch of its own samples through
   ``DataLoader`` (block shuffle, the default; prefetch thread on) and, in the same run,
   the same number of bytes with a raw sequential ``h5py`` read (``read_direct`` of its
   contiguous share of every shard in 8192-row slabs into a reused buffer: the fastest
   way to read the same bytes; also, for context, the same in batch-sized reads).
   Reported: GB/s summed over ranks (each pass is timed from a barrier to the slowest
   rank) and the ratio loader / raw slabs. Target: >= 0.8. The loop does nothing with
   the batches, so every batch costs a thread hand-off: the worst case for the thread.
2. **Input stall during training** of the reference ``mlp`` (784 -> 1024 -> 1024 -> 10,
   batch 128 per rank, SGD): the time each step waits for its batch, as a share of the
   step time. Target: < 5%. Uses ``mpidl.models.mlp`` when it imports, else (or with
   ``--simulate``) a fixed NumPy GEMM workload of the mlp's forward and backward size.

The data look like MNIST: 784 float32 features per sample (3136 bytes) and int64
labels, written once to ``--dir`` (default: a temporary directory, removed afterwards).
Reads are warm (page cache) unless ``--cold`` drops the files' guest cache before each pass.

Run from the repository root::

    .venv/bin/python benchmarks/data_read.py
    mpiexec -n 2 .venv/bin/python benchmarks/data_read.py
    .venv/bin/python benchmarks/data_read.py --samples 200000 --shuffle full --cold --json
"""

from __future__ import annotations

import os

# One BLAS thread per rank, as the benchmark protocol says (DESIGN.md).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpidl.comm import world  # noqa: E402
from mpidl.data import DataLoader, DistributedSampler, ShardedDataset  # noqa: E402
from mpidl.data.format import write_manifest  # noqa: E402
from mpidl.data.sampler import DEFAULT_BLOCK_SIZE, DEFAULT_WINDOW  # noqa: E402
from mpidl.data.shard_writer import make_manifest, storage_settings, write_rows  # noqa: E402

FEATURES = 784
SLAB = 8192  # rows per raw read_direct call


def make_dataset(comm: Any, args: argparse.Namespace) -> str:
    """Write the dataset once (rank 0), shard by shard, so that one larger than memory
    can be generated (``--samples``); rank 0 records the write's time and size in
    ``args.written``."""
    path = os.path.join(args.dir, "train")
    args.written = None
    if comm.rank == 0 and not os.path.isfile(os.path.join(path, "manifest.json")):
        rng = numpy.random.default_rng(0)
        per = args.rows_per_shard
        storage = storage_settings(None if args.compression == "none" else args.compression, None)
        one = {"x": numpy.empty((0, FEATURES), numpy.float32), "y": numpy.empty(0, numpy.int64)}
        new = path + ".new"
        os.makedirs(new)
        shards, seconds = [], 0.0
        # One shard's rows are drawn; shard i holds them rolled by i rows (labels shifted
        # by i): drawing 50 GB of random values would take the 2 cores most of an hour.
        x0 = rng.integers(0, 256, size=(min(per, args.samples), FEATURES), dtype=numpy.uint8)
        x0 = numpy.where(x0 < 205, 0, x0).astype(numpy.float32) / 255  # MNIST-like: ~80% 0
        y0 = rng.integers(0, 10, size=len(x0))
        for i, a in enumerate(range(0, args.samples, per)):
            n = min(per, args.samples - a)
            x, y = numpy.roll(x0, i, axis=0)[:n], (numpy.roll(y0, i)[:n] + i) % 10
            free = shutil.disk_usage(new).free
            if free - x.nbytes - y.nbytes < args.min_free_gb * 1e9:
                shutil.rmtree(new)
                raise SystemExit(f"data_read: {new}: writing shard {i} would leave less than "
                                 f"{args.min_free_gb} GB free ({free / 1e9:.1f} GB now): "
                                 "removed the partial dataset; use fewer --samples")
            t0 = time.perf_counter()  # the write alone (HDF5, sha256), not the generation
            shards += write_rows(new, {"x": x, "y": y}, storage, per, split="train",
                                 dataset_id="bench", first_shard=i,
                                 num_shards=-(-args.samples // per), first_sample=a,
                                 writer={})
            seconds += time.perf_counter() - t0
        write_manifest(new, make_manifest(one, shards, storage, split="train",
                                          dataset_id="bench", labels="y", num_classes=10,
                                          metadata={}, writer={}))
        os.rename(new, path)
        args.written = {"compression": args.compression, "rows_per_shard": per,
                        "shards": len(shards), "disk_MB": sum(s.bytes for s in shards) / 1e6,
                        "data_MB": args.samples * (FEATURES * 4 + 8) / 1e6,
                        "write_s": seconds}
    comm.barrier()
    return path


def drop_cache(ds: ShardedDataset) -> None:
    for i in range(len(ds.manifest.shards)):
        fd = os.open(ds.shard_path(i), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(comm: Any, fn: Callable[[], int]) -> tuple[float, int]:
    """(seconds from a common barrier to the slowest rank, bytes summed over ranks)."""
    comm.barrier()
    t0 = time.perf_counter()
    nbytes = fn()
    elapsed = time.perf_counter() - t0
    out = comm.allreduce(numpy.array([elapsed, float(nbytes)]), op="max")
    total = comm.allreduce(numpy.array([float(nbytes)]))
    return float(out[0]), int(total[0])


def raw_read(comm: Any, ds: ShardedDataset, files: list[Any], slab: int = SLAB,
             limit: float = float("inf"), first: int = 0) -> int:
    """This rank's contiguous 1/size share of every shard from shard ``first`` on, x and
    y, in ``slab``-row reads from the already open h5py ``files`` (one per shard); shards
    stop once ``limit`` bytes are read."""
    nbytes = 0
    buffers: dict[str, numpy.ndarray] = {}
    for i in from_shard(ds, first):
        shard, f = ds.manifest.shards[i], files[i]
        if nbytes >= limit:
            break
        lo = shard.rows * comm.rank // comm.size
        hi = shard.rows * (comm.rank + 1) // comm.size
        for name in ("x", "y"):
            d = f[name]
            buf = buffers.setdefault(name, numpy.empty((slab, *d.shape[1:]), dtype=d.dtype))
            for a in range(lo, hi, slab):
                b = min(a + slab, hi)
                d.read_direct(buf, numpy.s_[a:b], numpy.s_[0 : b - a])
                nbytes += buf[: b - a].nbytes
    return nbytes


def from_shard(ds: ShardedDataset, first: int) -> list[int]:
    """The shard indices from ``first`` on, wrapping around."""
    n = len(ds.manifest.shards)
    return [(first + k) % n for k in range(n)]


def dd_read(comm: Any, ds: ShardedDataset, limit: float = float("inf"), first: int = 0) -> int:
    """The disk's own sequential speed: ``dd`` of this rank's shards (``first + r, first +
    r + size, ...``, whole files, 16 MiB blocks) to /dev/null, until ``limit`` bytes;
    bytes read."""
    import subprocess

    nbytes = 0
    for i in from_shard(ds, first)[comm.rank :: comm.size]:
        if nbytes >= limit:
            break
        subprocess.run(["dd", f"if={ds.shard_path(i)}", "of=/dev/null", "bs=16M"],
                       check=True, capture_output=True)
        nbytes += ds.manifest.shards[i].bytes
    return nbytes


def open_shards(ds: ShardedDataset) -> None:
    """Open (and check) every shard of ``ds`` by reading one row of each."""
    for first, stop in zip(ds.offsets[:-1].tolist(), ds.offsets[1:].tolist()):
        ds.read_runs("x", [[first, min(first + 1, stop)]])


def loader_read(loader: DataLoader, epoch: int, limit: float = float("inf")) -> int:
    """One epoch of this rank's batches, or its first ``limit`` bytes; bytes read."""
    loader.set_epoch(epoch)
    nbytes = 0
    for x, y, _ in loader:
        nbytes += x.nbytes + y.nbytes
        if nbytes >= limit:
            break
    return nbytes


def make_sampler(
    comm: Any, ds: ShardedDataset, args: argparse.Namespace, seed: int
) -> DistributedSampler:
    """``args.batch`` samples per rank and step, in the order ``args`` asks for."""
    return DistributedSampler(len(ds), args.batch * comm.size, comm.rank, comm.size,
                              seed=seed, shuffle=args.shuffle, block_size=args.block_size,
                              window=args.window)


def bench_read(comm: Any, ds: ShardedDataset, args: argparse.Namespace) -> dict[str, Any]:
    sampler = make_sampler(comm, ds, args, seed=args.seed)
    loader = DataLoader(ds, sampler, prefetch=args.prefetch, readahead=args.readahead)
    raw, small, ours, disk = [], [], [], []
    # Both sides open their files once, outside the timings, as a training run does
    # (the same settings as the dataset's: HDF5 shares a file opened twice alike).
    # --cold closes and reopens them around dropping the page cache.
    import h5py

    def open_raw() -> list[Any]:
        return [h5py.File(ds.shard_path(i), "r", locking=False)
                for i in range(len(ds.manifest.shards))]

    files = open_raw()
    open_shards(ds)
    # Past the page cache, every reader must read bytes that no pass read before: this
    # machine's virtual disk is cached by its host (a shard read again, with the guest's
    # cache dropped: 1.1 GB/s, against 0.17-0.20 the first time). So with --pass-gb each
    # pass of raw reads and of dd takes the next shards, and the loader (random windows
    # of the whole split) reads first, before raw and dd have touched anything.
    cursor, shard_bytes = args.first_shard, max(s.bytes for s in ds.manifest.shards)
    try:
        for rep in range(args.repeats):
            limit = args.pass_gb * 1e9 / comm.size if args.pass_gb else float("inf")
            per_rank = -(-limit // shard_bytes) if args.pass_gb else 0
            first_raw, first_dd = cursor, cursor + int(per_rank * comm.size) + 1
            cursor = first_dd + int(per_rank * comm.size) + 1
            passes = [(lambda: loader_read(loader, rep, limit), ours),
                      (lambda: raw_read(comm, ds, files, limit=limit, first=first_raw), raw),
                      (lambda: raw_read(comm, ds, files, args.batch, limit, first_raw), small)]
            if args.dd:
                passes.append((lambda: dd_read(comm, ds, limit, first_dd), disk))
            if args.skip_small_reads:
                passes = [p for p in passes if p[1] is not small]
            for fn, into in passes:
                if args.cold:
                    ds.close()
                    for f in files:
                        f.close()
                    drop_cache(ds)
                    files = open_raw()
                    open_shards(ds)
                t, nbytes = timed(comm, fn)
                into.append(nbytes / t / 1e9)
    finally:
        for f in files:
            f.close()
    r, o = statistics.median(raw), statistics.median(ours)
    b = statistics.median(small) if small else float("nan")
    d = statistics.median(disk) if disk else float("nan")
    return {
        "bench": "read",
        "ranks": comm.size,
        "shuffle": args.shuffle,
        "block_size": args.block_size,
        "window": args.window,
        "batch_per_rank": args.batch,
        "prefetch": args.prefetch,
        "readahead": loader.readahead,
        "cold": args.cold,
        "raw_GBps": round(r, 3),
        "raw_batch_rows_GBps": round(b, 3),
        "loader_GBps": round(o, 3),
        "ratio": round(o / r, 3),
        "dd_GBps": round(d, 3),
        "loader_over_dd": round(o / d, 3),
        "raw_all": raw,
        "raw_batch_rows_all": small,
        "loader_all": ours,
        "dd_all": disk,
    }


def mlp_step(simulate: bool) -> tuple[Callable[[Any, Any], None], str]:
    """One training step of the reference mlp, or a GEMM workload of its size."""
    if not simulate:
        try:
            import mpidl.models as models
            from mpidl import functions as F
            from mpidl.optim import SGD

            model = models.mlp(seed=0)
            opt = SGD(model.parameters(), lr=0.01)

            def step(x: Any, y: Any) -> None:
                opt.zero_grad(set_to_none=True)
                loss = F.softmax_cross_entropy(model(x), y, reduction="sum")
                loss.backward()
                opt.step()

            return step, "mpidl.models.mlp"
        except ImportError:
            pass
    rng = numpy.random.default_rng(0)
    w = [
        rng.standard_normal(s).astype(numpy.float32) * 0.01
        for s in ((784, 1024), (1024, 1024), (1024, 10))
    ]

    def gemm(x: Any, y: Any) -> None:
        h1 = numpy.maximum(x @ w[0], 0)  # forward: (B, 784) -> (B, 1024) -> (B, 1024) -> (B, 10)
        h2 = numpy.maximum(h1 @ w[1], 0)
        g = h2 @ w[2]  # stands for the logits' gradient
        grads = [None, None, h2.T @ g]  # backward: weight and input gradients of each layer
        g2 = (g @ w[2].T) * (h2 > 0)
        grads[1] = h1.T @ g2
        g1 = (g2 @ w[1].T) * (h1 > 0)
        grads[0] = x.T @ g1
        for wi, gi in zip(w, grads):  # SGD
            wi -= 1e-6 * gi

    return gemm, "numpy GEMM of mlp size"


def bench_train(
    comm: Any, ds: ShardedDataset, args: argparse.Namespace, prefetch: int
) -> dict[str, Any]:
    step, kind = mlp_step(args.simulate)
    sampler = make_sampler(comm, ds, args, seed=args.seed + 1)
    loader = DataLoader(ds, sampler, prefetch=prefetch, readahead=args.readahead)
    loader.set_epoch(0)
    if args.cold:
        drop_cache(ds)
    it = iter(loader)
    for _ in range(args.warmup):
        x, y, _n = next(it)
        step(x, y)
    waits, works = [], []
    steps = min(args.train_steps, len(loader) - args.warmup)
    comm.barrier()
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y, _n = next(it)
        t1 = time.perf_counter()
        step(x, y)
        t2 = time.perf_counter()
        waits.append(t1 - t0)
        works.append(t2 - t1)
    it.close()
    wait, work = sum(waits), sum(works)
    worst = comm.allreduce(numpy.array([wait / (wait + work)]), op="max")
    return {
        "bench": "train",
        "ranks": comm.size,
        "step": kind,
        "prefetch": prefetch,
        "steps": steps,
        "step_ms": round(1e3 * (wait + work) / steps, 2),
        "wait_ms": round(1e3 * wait / steps, 3),
        "wait_p50_ms": round(1e3 * statistics.median(waits), 3),
        "wait_share_max_rank": round(float(worst[0]), 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--samples", type=int, default=100_000, help="samples in the dataset (100000: 314 MB)"
    )
    p.add_argument("--rows-per-shard", type=int, default=25_000)
    p.add_argument("--compression", choices=("none", "lzf", "gzip"), default="none",
                   help="shard storage: contiguous (none) or chunked and compressed (the "
                   "write is timed and sized only when the script writes the dataset)")
    p.add_argument("--dir", help="dataset directory (default: a temporary one, removed after)")
    p.add_argument("--min-free-gb", type=float, default=20.0,
                   help="stop writing (and remove the partial dataset) before the disk's "
                   "free space would fall below this (20)")
    p.add_argument("--batch", type=int, default=128, help="samples per rank per step (mlp: 128)")
    p.add_argument("--shuffle", choices=("block", "full", "none"), default="block")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="samples per window "
                   "of the block order (0: all blocks permuted at once, the order before "
                   f"windows; default {DEFAULT_WINDOW})")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--readahead", type=int, help="steps whose reads the loader advises "
                   "ahead (posix_fadvise; 0: off; default: the loader's, 16 for a split larger "
                   "than half the memory, else 0)")
    p.add_argument("--repeats", type=int, default=3, help="read passes; the median is reported")
    p.add_argument(
        "--cold", action="store_true", help="drop the files' page cache before each pass"
    )
    p.add_argument("--dd", action="store_true", help="also time `dd` of the shard files: the "
                   "disk's sequential speed (with --cold, past the page cache)")
    p.add_argument("--pass-gb", type=float, help="read at most this many GB per pass (all "
                   "ranks together): a sample of a split too large to read whole")
    p.add_argument("--seed", type=int, default=0, help="the loader's shuffle seed (the "
                   "training pass uses seed + 1): a new one reads other parts of the split")
    p.add_argument("--first-shard", type=int, default=0, help="with --pass-gb, the raw "
                   "and dd passes read shards from this one on (past shards earlier runs read)")
    p.add_argument("--skip-small-reads", action="store_true",
                   help="leave out the raw batch-sized reads (context only; a pass less)")
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--simulate", action="store_true", help="GEMM workload instead of mpidl's mlp")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (s) for the run")
    p.add_argument("--json", action="store_true", help="also print one JSON line per result")
    args = p.parse_args(argv)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    comm = world()
    temporary = args.dir is None
    if temporary:
        args.dir = comm.bcast_obj(
            tempfile.mkdtemp(prefix="mpidl-bench-") if comm.rank == 0 else None
        )
    try:
        ds = ShardedDataset(make_dataset(comm, args), comm=comm)
        results = [bench_read(comm, ds, args)]
        if not args.skip_train:  # the prefetch thread, then reading in the loop for reference
            for prefetch in dict.fromkeys((args.prefetch, 0)):
                results.append(bench_train(comm, ds, args, prefetch))
        if comm.rank == 0:
            w = args.written
            if w:
                print(f"| write | {w['compression']} | {w['shards']} shards of "
                      f"{w['rows_per_shard']} rows | {w['disk_MB']:.0f} MB on disk for "
                      f"{w['data_MB']:.0f} MB of data ({w['data_MB'] / w['disk_MB']:.2f}x) | "
                      f"{w['write_s']:.1f} s, {w['data_MB'] / 1e3 / w['write_s']:.2f} GB/s |")
            r = results[0]
            print(
                f"| read | {r['ranks']} | {r['shuffle']} (block {r['block_size']}, window "
                f"{r['window']}, prefetch "
                f"{r['prefetch']}, readahead {r['readahead']}{', cold' if r['cold'] else ''}) | raw h5py {r['raw_GBps']} GB/s ({r['raw_batch_rows_GBps']} in "
                f"{r['batch_per_rank']}-row reads) | loader {r['loader_GBps']} GB/s "
                f"| ratio {r['ratio']} |"
                + (f" dd {r['dd_GBps']} GB/s | loader / dd {r['loader_over_dd']} |"
                   if args.dd else "")
            )
            for t in results[1:]:
                print(
                    f"| train | {t['ranks']} | {t['step']}, prefetch {t['prefetch']} "
                    f"| step {t['step_ms']} ms "
                    f"| wait {t['wait_ms']} ms (median {t['wait_p50_ms']}) | wait share "
                    f"{100 * t['wait_share_max_rank']:.2f}% |"
                )
            if args.json:
                for res in results + ([{"bench": "write", **w}] if w else []):
                    print(json.dumps(res))
    finally:
        ds.close() if "ds" in locals() else None
        comm.barrier()
        if temporary and comm.rank == 0:
            shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
