"""The time and memory of activation recomputation (#26) on a GPT: none, selective, full.

One process, one thread (``OMP_NUM_THREADS=1`` and friends, threadpoolctl when
installed), float32. Per mode: a training step (forward + loss + backward + AdamW) timed
in rounds that alternate the modes (so load on a shared machine hits all three alike),
the median step per mode and its ratio to ``none``, in wall time and in the process's
CPU time (user + system: with one thread, the fairer measure on a machine shared with
other work, which stretches wall time by 2-5x); the forward alone of ``none``, so the
extra time of ``full`` reads in forwards (expected about one); the bytes the graph
keeps for backward (:func:`mpidl.nn.recompute.saved_bytes`) and the peak traced memory of
forward + backward (:func:`mpidl.testing.memory.peak_bytes`, in a separate untimed pass:
tracing slows allocation). glibc keeps freed memory for the next step, as ``mpidl train``
does (``keep_freed_memory``, :func:`mpidl.backend.keep_freed_memory`); ``--malloc
default`` gives it back, so every step page-faults its activations in again, a cost that
grows with the bytes kept (``none`` pays most, ``full`` least). Not part of CI. Run from
the repository root::

    .venv/bin/python benchmarks/recompute.py                      # gpt: d 256, 4 layers, T 256
    .venv/bin/python benchmarks/recompute.py --seq 512 --batch 4 --rounds 5
    .venv/bin/python benchmarks/recompute.py --json recompute.json
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mpidl.autograd import no_grad  # noqa: E402
from mpidl.backend import keep_freed_memory  # noqa: E402
from mpidl.models import GPT  # noqa: E402
from mpidl.nn.recompute import RECOMPUTE, saved_bytes  # noqa: E402
from mpidl.optim import AdamW  # noqa: E402
from mpidl.testing.memory import peak_bytes  # noqa: E402


def one_thread() -> None:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(limits=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--seq", type=int, default=256, help="tokens per sample (T)")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds over the modes")
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode and round")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: glibc keeps freed memory, as mpidl train does (default)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    one_thread()
    if args.malloc == "keep":
        keep_freed_memory()
    shape = dict(vocab=args.vocab, seq_len=args.seq, dim=args.dim, layers=args.layers,
                 heads=args.heads, dropout=args.dropout, seed=0)
    ids = numpy.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1))
    runs = {}
    for mode in RECOMPUTE:
        model = GPT(**shape, recompute=mode)
        runs[mode] = (model, AdamW(model.parameters(), lr=1e-4))

    def step(mode: str) -> tuple[float, float]:
        model, opt = runs[mode]
        t0, c0 = time.perf_counter(), time.process_time()
        model.zero_grad()
        model.loss(ids, reduction="mean").backward()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    def forward() -> tuple[float, float]:
        model = runs["none"][0]
        t0, c0 = time.perf_counter(), time.process_time()
        with no_grad():
            model.loss(ids, reduction="mean")
        return time.perf_counter() - t0, time.process_time() - c0

    for mode in RECOMPUTE:  # warm-up: allocator, BLAS, the first AdamW state
        step(mode)
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in RECOMPUTE}
    forwards: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        for mode in RECOMPUTE:
            times[mode] += [step(mode) for _ in range(args.steps)]
        forwards += [forward() for _ in range(args.steps)]

    result = {"shape": shape, "batch": args.batch, "malloc": args.malloc, "modes": {}}
    base = [statistics.median(t[i] for t in times["none"]) for i in (0, 1)]
    fwd = [statistics.median(t[i] for t in forwards) for i in (0, 1)]
    result["forward_s"], result["forward_cpu_s"] = fwd
    print(f"gpt d={args.dim} layers={args.layers} heads={args.heads} T={args.seq} "
          f"B={args.batch} dropout={args.dropout}, float32, 1 thread, malloc {args.malloc}; "
          f"{args.rounds} rounds x {args.steps} steps per mode")
    print(f"forward alone (none, no graph): {fwd[0] * 1e3:.1f} ms wall, "
          f"{fwd[1] * 1e3:.1f} ms CPU")
    print(f"{'mode':<10} {'step ms':>9} {'vs none':>8} {'CPU ms':>9} {'vs none':>8} "
          f"{'extra fwds':>10} {'kept MiB':>9} {'peak MiB':>9}")
    for mode in RECOMPUTE:
        model = runs[mode][0]
        model.zero_grad()
        kept = saved_bytes(model.loss(ids, reduction="mean"))
        model.zero_grad()
        _, peak = peak_bytes(lambda: model.loss(ids, reduction="mean").backward())
        t = [statistics.median(x[i] for x in times[mode]) for i in (0, 1)]
        extra = (t[1] - base[1]) / fwd[1]  # in CPU time
        row = {"step_s": t[0], "ratio": t[0] / base[0], "step_cpu_s": t[1],
               "cpu_ratio": t[1] / base[1], "extra_forwards_cpu": extra,
               "kept_bytes": kept, "peak_bytes": peak}
        result["modes"][mode] = row
        print(f"{mode:<10} {t[0] * 1e3:9.1f} {t[0] / base[0]:8.3f} {t[1] * 1e3:9.1f} "
              f"{t[1] / base[1]:8.3f} {extra:10.2f} {kept / 2**20:9.2f} {peak / 2**20:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
