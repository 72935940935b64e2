"""Single-process training throughput of mpidl's engine against PyTorch CPU, same run.

Protocol (DESIGN.md "Reference models and benchmark protocol"): float32, synthetic
pre-generated batches, per step ``zero_grad`` + forward + softmax cross-entropy +
backward + SGD step (lr 0.01), one thread (``OMP_NUM_THREADS=1`` and friends, torch
``set_num_threads(1)``, threadpoolctl when installed), a warm-up, then several timed
windows; samples/s is the median over the windows. Every (model, framework) pair runs in
its own subprocess, so peak memory is that process's ``ru_maxrss`` growth from just before
the model is built, and one framework's allocator cannot flatter or hurt the other.

Run from the repository root::

    .venv/bin/python benchmarks/engine.py                         # all models, both engines
    .venv/bin/python benchmarks/engine.py --models mlp --window-s 1 --windows 3
    .venv/bin/python benchmarks/engine.py --rounds 3     # a noisy machine: alternate, pool
    .venv/bin/python benchmarks/engine.py --models transformer --profile   # cProfile of mpidl
    .venv/bin/python benchmarks/engine.py --malloc keep   # glibc keeps freed memory (both)

PyTorch is optional (``pip install torch``); without it only mpidl's rows are printed.
Prints a markdown table, plus one JSON line per measurement with ``--json``.
"""
from __future__ import annotations

import os

# Before numpy/torch load their thread pools: one thread per process, as the protocol says.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpi_timing import MALLOC_KEEP  # noqa: E402  (the shared --malloc keep policy)

import numpy  # noqa: E402

# model -> (batch, input kind and shape, classes); DESIGN.md's table.
CASES = {
    "mlp": {"batch": 128, "classes": 10},
    "bow": {"batch": 64, "tokens": 256, "vocab": 20000, "classes": 2},
    "transformer": {"batch": 32, "tokens": 128, "vocab": 8000, "classes": 2},
}
N_BATCHES = 8  # distinct pre-generated batches, cycled


def make_batches(model: str) -> list[tuple[numpy.ndarray, numpy.ndarray]]:
    case = CASES[model]
    rng = numpy.random.default_rng(0)
    out = []
    for _ in range(N_BATCHES):
        if model == "mlp":
            x = rng.standard_normal((case["batch"], 784)).astype(numpy.float32)
        else:
            x = rng.integers(0, case["vocab"], size=(case["batch"], case["tokens"]))
        y = rng.integers(0, case["classes"], size=case["batch"])
        out.append((x, y))
    return out


def limit_threads() -> None:
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1)
    except ImportError:
        pass


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def mpidl_step(model_name: str) -> tuple[Callable[[Any], None], int]:
    import mpidl.models as models
    from mpidl import functions as F
    from mpidl.optim import SGD

    model = models.build(model_name, seed=0)
    return sgd_step(model, SGD(model.parameters(), lr=0.01), F.softmax_cross_entropy), \
        model.num_parameters()


def sgd_step(model: Any, opt: Any, loss_fn: Callable) -> Callable[[Any], None]:
    """One training step of the protocol on a batch ``(x, y)``, for either engine:
    zero_grad (to None), forward, ``loss_fn(model(x), y)``, backward, optimizer step."""
    def step(batch: Any) -> None:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    return step


def torch_model(name: str) -> Any:
    import torch
    from torch import nn

    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, 10))
    if name == "bow":
        class Bow(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.EmbeddingBag(20000, 128, mode="mean")
                self.fc1, self.fc2 = nn.Linear(128, 256), nn.Linear(256, 2)

            def forward(self, ids):
                return self.fc2(torch.relu(self.fc1(self.embed(ids))))
        return Bow()

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(8000, 128)
            self.pos = nn.Parameter(torch.randn(128, 128) * 0.02)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, activation="gelu",
                                           norm_first=True, batch_first=True)
                for _ in range(2))
            self.head = nn.Linear(128, 2)

        def forward(self, ids):
            x = self.tok(ids) + self.pos[: ids.shape[1]]
            for layer in self.layers:
                x = layer(x)
            return self.head(x.mean(dim=1))
    return Transformer()


def torch_step(model_name: str) -> tuple[Callable[[Any], None], int]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return sgd_step(model, opt, torch.nn.functional.cross_entropy), \
        sum(p.numel() for p in model.parameters())


def worker(args: argparse.Namespace) -> dict:
    """Measure one (model, framework) pair in this process; returns the result record."""
    return measure("engine", args.model, make_batches(args.model), CASES[args.model]["batch"],
                   mpidl_step, torch_step, args, min_warmup_steps=3)


def measure(bench: str, name: str, batches: list, batch: int, mpidl_factory: Callable,
            torch_factory: Callable, args: argparse.Namespace, min_warmup_steps: int) -> dict:
    """Build ``args.framework``'s step for ``name`` (``factory(name) -> (step, params)``)
    and time it on ``batches`` (NumPy; handed to torch as tensors); the result record.
    Imports happen before the memory baseline, so peak memory is the model's own."""
    limit_threads()
    if args.framework == "torch":
        import torch

        batches = [tuple(torch.from_numpy(a) for a in b) for b in batches]
        make = torch_factory
    else:
        import mpidl.functions  # noqa: F401  (import cost outside the memory baseline)
        import mpidl.models  # noqa: F401
        import mpidl.optim  # noqa: F401

        make = mpidl_factory
    base_rss = rss_bytes()
    step, n_params = make(name)
    return dict(bench=bench, model=name, framework=args.framework, batch=batch,
                params=n_params, threads=1,
                **time_windows(step, batches, batch, args, base_rss, min_warmup_steps))


def time_windows(step: Callable[[Any], None], batches: list, batch: int,
                 args: argparse.Namespace, base_rss: int, min_warmup_steps: int) -> dict:
    """Warm up, then time ``args.windows`` windows of ``args.window_s`` seconds of
    ``step`` over the cycled ``batches``; the measurement fields of a result record
    (samples/s median and range, CPU share, peak memory above ``base_rss``)."""
    i = 0
    t_end = time.perf_counter() + args.warmup_s
    while time.perf_counter() < t_end or i < min_warmup_steps:
        step(batches[i % len(batches)])
        i += 1
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    rates, cpu_rates, cpu_shares = [], [], []
    for _ in range(args.windows):
        n = 0
        c0, t0 = time.process_time(), time.perf_counter()
        while True:
            step(batches[i % len(batches)])
            i += 1
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= args.window_s:
                break
        cpu = time.process_time() - c0
        rates.append(n * batch / elapsed)
        cpu_rates.append(n * batch / max(cpu, 1e-9))
        cpu_shares.append(cpu / elapsed)
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "samples_per_s": {"median": statistics.median(rates), "min": min(rates),
                          "max": max(rates), "n": len(rates)},
        "step_ms": 1e3 * batch / statistics.median(rates),
        "peak_mem_mib": max(0, peak - base_rss) / 2**20,
        "cpu_share": statistics.median(cpu_shares),
        "samples_per_cpu_s": statistics.median(cpu_rates),
        "rates": rates, "cpu_rates": cpu_rates, "shares": cpu_shares,
    }


def _merge(acc: dict | None, rec: dict) -> dict:
    """Pool the windows of several rounds: median over all of them, largest peak memory."""
    keys = ("rates", "cpu_rates", "shares")
    rec = dict(rec, **{k: list(rec[k]) for k in keys})
    if acc is not None:
        for k in keys:
            rec[k] = acc[k] + rec[k]
        rec["peak_mem_mib"] = max(acc["peak_mem_mib"], rec["peak_mem_mib"])
    rates = rec["rates"]
    rec["samples_per_s"] = {"median": statistics.median(rates), "min": min(rates),
                            "max": max(rates), "n": len(rates)}
    rec["step_ms"] = 1e3 * rec["batch"] / rec["samples_per_s"]["median"]
    rec["cpu_share"] = statistics.median(rec["shares"])
    rec["samples_per_cpu_s"] = statistics.median(rec["cpu_rates"])
    return rec


def _rate(r: dict | None) -> str:
    if r is None:
        return "–"
    s = r["samples_per_s"]
    return f"{s['median']:,.0f} ({s['min']:,.0f}–{s['max']:,.0f})"


def torch_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("torch") is not None
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,bow,transformer",
                   help="comma-separated subset of mlp,bow,transformer")
    add_protocol_arguments(p)
    p.add_argument("--model", help=argparse.SUPPRESS)  # internal: the worker's model
    args = p.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    compare(p, args, __file__, "model", args.models, CASES)
    print("ratio per CPU-s: samples per second of process CPU time, the fairer ratio when "
          "other processes take part of the core")
    return 0


def compare(p: argparse.ArgumentParser, args: argparse.Namespace, script: str, kind: str,
            requested: str, cases: dict) -> None:
    """Measure the comma-separated ``requested`` cases with mpidl and (when installed)
    torch, one process per pair (``script --worker --<kind> NAME``), and print the table."""
    names = [m.strip() for m in requested.split(",") if m.strip()]
    unknown = [m for m in names if m not in cases]
    if unknown:
        p.error(f"unknown {kind}s {unknown}; choose from {sorted(cases)}")
    frameworks = ["mpidl"] + ([] if args.no_torch or not torch_available() else ["torch"])
    results = run_workers(script, f"--{kind}", names, frameworks, args)
    print_table(kind, names, results)
    print(f"glibc heap policy (--malloc): {args.malloc}")


def add_protocol_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the protocol (windows, rounds, peers, heap policy) and the worker's."""
    p.add_argument("--window-s", type=float, default=2.0, help="length of one timed window")
    p.add_argument("--windows", type=int, default=5, help="number of timed windows")
    p.add_argument("--warmup-s", type=float, default=1.0, help="untimed warm-up")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every measurement, alternating the engines' order; the "
                        "median is over the windows of all rounds")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    p.add_argument("--profile", action="store_true", help="cProfile mpidl's timed steps")
    p.add_argument("--json", action="store_true", help="also print one JSON line per run")
    p.add_argument("--malloc", choices=("default", "keep"), default="default",
                   help="glibc heap policy in both engines' processes: 'default', or "
                        "'keep' freed memory instead of returning it to the kernel (no "
                        "page faults per step; see MALLOC_KEEP; what DataParallel, hence "
                        "`mpidl train`, sets)")
    # Internal: run one measurement in this process.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)


def run_workers(script: str, flag: str, names: list[str], frameworks: list[str],
                args: argparse.Namespace) -> dict[tuple[str, str], dict]:
    """Measure every (name, framework) pair in its own process (``script --worker flag
    name``), ``args.rounds`` times with the engines' order alternating; pooled records."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.malloc == "keep":
        env.update(MALLOC_KEEP)
    results: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for name in names:
            # Alternate which engine goes first, so a change in the machine's load
            # between two runs does not always favour the same one.
            for fw in (frameworks if r % 2 == 0 else frameworks[::-1]):
                cmd = [sys.executable, os.path.abspath(script), "--worker", flag, name,
                       "--framework", fw, "--window-s", str(args.window_s),
                       "--windows", str(args.windows), "--warmup-s", str(args.warmup_s)]
                if args.profile and fw == "mpidl":
                    cmd.append("--profile")
                out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                     check=True)
                rec = json.loads(out.stdout.strip().splitlines()[-1])
                if args.json:
                    print(json.dumps(rec), flush=True)
                results[(name, fw)] = _merge(results.get((name, fw)), rec)
    return results


def print_table(first: str, names: list[str], results: dict[tuple[str, str], dict]) -> None:
    """The markdown table of mpidl against torch per name, then the CPU shares."""
    print(f"| {first} | batch | params | mpidl samples/s | torch samples/s | ratio "
          "| ratio per CPU-s | mpidl step ms | torch step ms | mpidl peak MiB | torch peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        m, t = results[(name, "mpidl")], results.get((name, "torch"))
        cells = [name, str(m["batch"]), f"{m['params']:,}", _rate(m), _rate(t)]
        if t is not None:
            cells += [f"{m['samples_per_s']['median'] / t['samples_per_s']['median']:.2f}x",
                      f"{m['samples_per_cpu_s'] / t['samples_per_cpu_s']:.2f}x"]
        else:
            cells += ["–", "–"]
        cells += [f"{m['step_ms']:.1f}", f"{t['step_ms']:.1f}" if t else "–",
                  f"{m['peak_mem_mib']:.0f}", f"{t['peak_mem_mib']:.0f}" if t else "–"]
        print("| " + " | ".join(cells) + " |")
    shares = ", ".join(f"{k[0]}/{k[1]} {v['cpu_share']:.2f}" for k, v in results.items())
    print(f"\nCPU share during the timed windows (1.0 = had its core): {shares}")


if __name__ == "__main__":
    sys.exit(main())
