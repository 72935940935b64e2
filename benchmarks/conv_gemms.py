"""The conv2d case's three GEMMs alone, against the whole layer in mpidl and in PyTorch.

``conv.py``'s conv2d case (Conv2d 64 x 32 x 14 x 14 -> 64, 3x3, pad 1, forward + backward
with both gradients, float32, one thread) does three GEMMs of 0.46 GFLOP each in mpidl:
forward ``W (64, 288) @ cols (288, 12,544)``, the weight gradient ``cols @ gy^T`` and the
input gradient ``W^T @ gy``. Here each GEMM runs alone through NumPy's BLAS (OpenBLAS,
in every orientation that gives the same product) on arrays of the layer's shapes,
alternating in one process with mpidl's layer and PyTorch's (oneDNN) layer, each timed by
``time.process_time`` over ``--reps`` calls, median of ``--rounds`` rounds. The sum of the
fastest orientations is the floor of the GEMM path: what the layer would cost with no
unfolding, no transposes and nothing else (benchmarks/README.md, #30). Not part of CI::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/conv_gemms.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy  # noqa: E402

import conv  # noqa: E402


def gemms(rng: Any) -> dict[str, Callable[[], Any]]:
    """The layer's three products, each in the orientations that give it."""
    cin, cout, k, _ = conv.CASES["conv2d"]["layer"]
    batch = conv.CASES["conv2d"]["batch"]
    n = batch * conv.CASES["conv2d"]["shape"][1] * conv.CASES["conv2d"]["shape"][2]
    ck = cin * k * k
    w = rng.standard_normal((cout, ck), dtype=numpy.float32)
    cols = rng.standard_normal((ck, n), dtype=numpy.float32)
    gy = rng.standard_normal((cout, n), dtype=numpy.float32)
    return {
        "forward W @ cols": lambda: w @ cols,
        "forward (cols^T @ W^T)^T": lambda: cols.T @ w.T,
        "weight gradient gy @ cols^T": lambda: gy @ cols.T,
        "weight gradient (cols @ gy^T)^T": lambda: cols @ gy.T,
        "input gradient W^T @ gy": lambda: w.T @ gy,
        "input gradient (gy^T @ W)^T": lambda: gy.T @ w,
    }


def layers() -> dict[str, Callable[[], Any]]:
    """mpidl's and PyTorch's whole layer, forward + backward, on one fixed batch."""
    import torch

    batch = conv.make_batches("conv2d", count=1)[0]
    mpidl_step, _ = conv.mpidl_step("conv2d")
    torch_step, _ = conv.torch_step("conv2d")
    torch_batch = (torch.from_numpy(batch[0]), torch.from_numpy(batch[1]))
    return {"mpidl layer": lambda: mpidl_step(batch),
            "PyTorch layer": lambda: torch_step(torch_batch)}


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Milliseconds of CPU time per call, over ``reps`` calls."""
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) / reps * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=10, help="calls timed together")
    args = p.parse_args(argv)
    cases = {**gemms(numpy.random.default_rng(0)), **layers()}
    for fn in cases.values():  # warm-up: first-touch pages, BLAS buffers
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(timed(fn, args.reps))
    ms = {name: statistics.median(v) for name, v in times.items()}
    flop = 2 * 64 * 288 * 12544 / 1e9
    best = {what: min(v for name, v in ms.items() if name.startswith(what))
            for what in ("forward", "weight gradient", "input gradient")}
    floor = sum(best.values())
    print(json.dumps({"bench": "conv_gemms", "ms": ms, "gemm_floor_ms": floor}), flush=True)
    print("\n| what | ms (median CPU time) | GFLOP/s |\n|---|---|---|")
    for name, v in ms.items():
        rate = f"{flop / v * 1e3:.1f}" if "layer" not in name else ""
        print(f"| {name} | {v:.2f} | {rate} |")
    print(f"| the fastest of each GEMM, summed | {floor:.2f} | {3 * flop / floor * 1e3:.1f} |")
    torch_ms = ms["PyTorch layer"]
    print(f"\nGEMM floor / PyTorch's whole layer: {floor / torch_ms:.2f}; "
          f"mpidl's layer / PyTorch's: {ms['mpidl layer'] / torch_ms:.2f} "
          f"(speed ratio {torch_ms / ms['mpidl layer']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
