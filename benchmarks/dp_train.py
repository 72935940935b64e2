"""Data-parallel training throughput: mpidl DataParallel vs PyTorch DDP (gloo), same run.

Protocol (DESIGN.md "Reference models and benchmark protocol"): the reference models,
float32, batch per rank 128 (mlp) / 64 (bow) / 32 (transformer) / 8 (cosmoflow),
synthetic pre-generated batches (different on every rank), per step forward + loss
(softmax cross-entropy; cosmoflow: mean squared error against 4 float targets) +
backward (+ gradient allreduce) + SGD step (lr 0.01) + zero_grad, one thread per rank,
a warm-up, then timed windows. A window's time is the slowest rank's; samples/s counts
every rank's samples (weak scaling: the global batch grows with the ranks). Weak-scaling
efficiency = samples/s at N ranks / (N x samples/s at 1 rank). Samples per CPU-second
divides by the process CPU time of all ranks (threads included) over the whole timed
run, warm-up included: the fairer ratio when the machine is shared.

- mpidl: ``loss = softmax_cross_entropy(dp(x), y, reduction="sum");
  dp.backward(loss, global_count=n); opt.step(); opt.zero_grad()`` with
  :class:`mpidl.parallel.DataParallel` (at 1 rank too: the same user code); cosmoflow:
  ``regression_loss(dp(x), y, reduction="sum")`` with ``global_count`` = values in the
  global batch (samples x 4 outputs), as ``mpidl.train.objective.Regression``.
- PyTorch: ``DistributedDataParallel`` on gloo over loopback at 2 ranks, the plain model
  at 1 rank (the stronger baseline). PyTorch's embedding gradients are dense.
- ``bare`` (1 rank only): mpidl's model without DataParallel (backward seeded with
  ``1/n`` as DataParallel does, the same heap policy): what wrapping costs at 1 rank.
- ``gpt``: the gpt preset's model (mpidl only), next-token loss over 16 x 32 tokens.

The 3-D CNN (``mpidl.models.cosmoflow`` on 4 x 32^3 volumes; PyTorch: ``conv.py``'s
``torch_model``, the same layers in the same order) comes in three cases:

- ``cosmoflow``: no batch norm (the MLPerf reference's default configuration).
- ``cosmoflow-bn``: ``BatchNorm3d`` after each (bias-free) convolution, per-rank
  statistics on both sides (``DataParallel(sync_batchnorm=False)``, DDP), rank 0's
  running statistics broadcast before each forward by both.
- ``cosmoflow-syncbn``: the same model, mpidl with ``DataParallel(sync_batchnorm=True)``
  (statistics of the global batch), PyTorch with ``SyncBatchNorm.convert_sync_batchnorm``
  under DDP. PyTorch 2.13 refuses SyncBatchNorm on CPU (DDP: "SyncBatchNorm layers only
  work with GPU modules"; the layer alone: "SyncBatchNorm expected input tensor to be on
  GPU ..."), so at 2 ranks its side falls back to what a CPU user is left with, DDP with
  per-rank ``BatchNorm3d``; the record says so (``batchnorm``, ``batchnorm_note``) and
  the table marks the row. At 1 rank both are plain batch norm.

Token ids: real text follows Zipf's law, so by default ``bow`` and ``transformer``
batches draw ids with probability proportional to 1/rank (over a fixed random
permutation of the vocabulary); ``--ids uniform`` draws them uniformly (many more
distinct rows per batch, the worst case for mpidl's sparse embedding exchange).

Every (framework, ranks) pair is one ``mpiexec`` launch; PyTorch's ranks find each other
through MASTER_ADDR/MASTER_PORT, RANK and WORLD_SIZE taken from Open MPI's environment.
Run from the repository root::

    .venv/bin/python benchmarks/dp_train.py                    # mlp, bow, transformer; 1, 2 ranks
    .venv/bin/python benchmarks/dp_train.py --models cosmoflow,cosmoflow-bn,cosmoflow-syncbn
    .venv/bin/python benchmarks/dp_train.py --models bow --ids uniform
    .venv/bin/python benchmarks/dp_train.py --malloc keep     # glibc keeps freed memory (both)
    .venv/bin/python benchmarks/dp_train.py --malloc default  # glibc's default policy (both)
    .venv/bin/python benchmarks/dp_train.py --models mlp --no-sync   # no allreduce: the ceiling
    .venv/bin/python benchmarks/dp_train.py --models bow,mlp,transformer,gpt \
        --frameworks mpidl,bare --rounds 3   # #30's ratios: weak scaling, DataParallel's cost
    .venv/bin/python benchmarks/dp_train.py --rounds 2 --mca coll_tuned_use_dynamic_rules=1 \\
        --mca coll_tuned_allreduce_algorithm=4

Prints one JSON line per measurement, then a markdown table.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from typing import Callable  # noqa: E402

import numpy  # noqa: E402

import conv  # noqa: E402
import mpi_timing as mt  # noqa: E402

COSMOFLOW = conv.CASES["cosmoflow"]  # batch 8, 4 x 32^3 volumes, 4 targets
CASES = {
    "mlp": {"batch": 128, "classes": 10},
    "bow": {"batch": 64, "tokens": 256, "vocab": 20000, "classes": 2},
    "transformer": {"batch": 32, "tokens": 128, "vocab": 8000, "classes": 2},
    # the gpt preset's model (dim 64, 2 blocks, 4 heads) on sequences of 32 next tokens,
    # 16 per rank (the preset's global batch of 32 at 2 ranks); mpidl only
    "gpt": {"batch": 16, "tokens": 33, "vocab": 64, "classes": 64,
            "model": {"vocab": 64, "seq_len": 32, "dim": 64, "layers": 2, "heads": 4}},
    # batchnorm: none, per-rank (plain BatchNorm3d under data parallelism), sync
    "cosmoflow": {"batch": COSMOFLOW["batch"], "batchnorm": "none"},
    "cosmoflow-bn": {"batch": COSMOFLOW["batch"], "batchnorm": "per-rank"},
    "cosmoflow-syncbn": {"batch": COSMOFLOW["batch"], "batchnorm": "sync"},
}
N_BATCHES = 8


def make_batches(model: str, rank: int, ids: str) -> list[tuple[numpy.ndarray, numpy.ndarray]]:
    """This rank's pre-generated batches (a different stream on every rank)."""
    case = CASES[model]
    if "batchnorm" in case:
        return conv.make_batches("cosmoflow", seed=1000 + rank, count=N_BATCHES)
    rng = numpy.random.default_rng(1000 + rank)
    if "vocab" in case:
        vocab = case["vocab"]
        order = numpy.random.default_rng(7).permutation(vocab)  # same on every rank
        zipf = 1.0 / numpy.arange(1, vocab + 1)
        zipf /= zipf.sum()
    out = []
    for _ in range(N_BATCHES):
        if model == "mlp":
            x = rng.standard_normal((case["batch"], 784)).astype(numpy.float32)
        elif ids == "zipf":
            x = order[rng.choice(vocab, size=(case["batch"], case["tokens"]), p=zipf)]
        else:
            x = rng.integers(0, vocab, size=(case["batch"], case["tokens"]))
        if "model" in case:  # next-token prediction: the inputs and their next tokens
            x, y = x[:, :-1], x[:, 1:]
        else:
            y = rng.integers(0, case["classes"], size=case["batch"])
        out.append((x, y))
    return out


def mpidl_step(args: argparse.Namespace, batches: list) -> tuple[Callable[[], None], dict]:
    import mpidl.comm
    import mpidl.models as models
    from mpidl import functions as F
    from mpidl.optim import SGD
    from mpidl.parallel.data import DataParallel

    comm = mpidl.comm.world()
    case = CASES[args.model]
    kwargs: dict = {} if args.bucket_mb is None else {"bucket_mb": args.bucket_mb}
    if "batchnorm" in case:
        model = models.build("cosmoflow", in_shape=COSMOFLOW["shape"],
                             outputs=COSMOFLOW["outputs"],
                             batch_norm=case["batchnorm"] != "none", seed=0)
        kwargs["sync_batchnorm"] = case["batchnorm"] == "sync"
        loss_fn = partial(F.regression_loss, reduction="sum")
        global_count = case["batch"] * comm.size * COSMOFLOW["outputs"]  # values, not samples
    elif "model" in case:  # a language model: every position predicts the next token
        model = models.build(args.model, seed=0, **case["model"])
        global_count = case["batch"] * comm.size * (case["tokens"] - 1)

        def loss_fn(logits, y):
            return F.softmax_cross_entropy(logits.reshape(-1, case["vocab"]), y.reshape(-1),
                                           reduction="sum")
    else:
        model = models.build(args.model, seed=0)
        loss_fn = partial(F.softmax_cross_entropy, reduction="sum")
        global_count = case["batch"] * comm.size
    # "own" and "keep": DataParallel's default; "default": glibc's policy as torch has it.
    kwargs["keep_freed_memory"] = args.malloc != "default"
    if args.overlap is not None:
        kwargs["overlap"] = args.overlap == "on"
    state = {"i": 0, "wait": [], "sparse": 0}
    if args.framework == "bare":  # the model alone, DataParallel's 1-rank cost measured
        if comm.size != 1 and not getattr(args, "independent", False):
            raise SystemExit("dp_train.py: the bare model runs at 1 rank only")
        if kwargs["keep_freed_memory"]:
            from mpidl import backend

            backend.keep_freed_memory()  # as DataParallel(keep_freed_memory=True) does
        opt = SGD(model.parameters(), lr=0.01)

        def bare_step() -> None:
            x, y = batches[state["i"] % N_BATCHES]
            state["i"] += 1
            loss = loss_fn(model(x), y)
            seed = numpy.full(loss.shape, 1.0 / global_count, dtype=loss.dtype)
            loss.backward(seed)  # what dp.backward seeds at 1 rank
            opt.step()
            opt.zero_grad()
        return bare_step, {"extra": dict, "params": model.num_parameters(), "batchnorm": None}
    dp = DataParallel(model, comm, **kwargs)
    opt = SGD(model.parameters(), lr=0.01)

    def step() -> None:
        x, y = batches[state["i"] % N_BATCHES]
        state["i"] += 1
        loss = loss_fn(dp(x), y)
        with dp.no_sync() if args.no_sync else contextlib.nullcontext():
            dp.backward(loss, global_count=global_count)
        opt.step()
        opt.zero_grad()
        state["wait"].append(dp.comm_wait_seconds)
        state["sparse"] += int(dp.sparse_used)

    def extra() -> dict:
        return {"bucket_mb": dp.bucket_mb, "overlap": dp.overlap, "buckets": len(dp.buckets),
                "transport": dp.transport.name,
                "comm_wait_ms": 1e3 * statistics.median(state["wait"]) if state["wait"] else 0,
                "sparse_step_share": state["sparse"] / max(1, state["i"])}
    return step, {"extra": extra, "params": model.num_parameters(),
                  "batchnorm": case.get("batchnorm")}


def torch_step(args: argparse.Namespace, batches: list) -> tuple[Callable[[], None], dict]:
    import copy
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from engine import torch_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    case = CASES[args.model]
    batchnorm, note = case.get("batchnorm"), None
    if batchnorm is not None:
        warnings.filterwarnings("ignore", message="Using padding='same'")
        model = conv.torch_model("cosmoflow", batch_norm=batchnorm != "none")
        loss_fn = torch.nn.functional.mse_loss  # mean over the values; DDP averages ranks
    else:
        model = torch_model(args.model)
        loss_fn = torch.nn.functional.cross_entropy
    n_params = sum(p.numel() for p in model.parameters())
    if world > 1:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = str(world)
        dist.init_process_group("gloo", init_method="env://")
        ddp = None
        if batchnorm == "sync":
            try:  # convert_sync_batchnorm rewires the model in place: convert a copy
                ddp = DistributedDataParallel(
                    torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(model)))
            except ValueError as e:  # raised on every rank, after the same collectives
                batchnorm, note = "per-rank", f"torch.nn.SyncBatchNorm refused: {e}"
        model = ddp if ddp is not None else DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    state = {"i": 0}

    def step() -> None:
        x, y = batches[state["i"] % N_BATCHES]
        state["i"] += 1
        with model.no_sync() if args.no_sync and world > 1 else contextlib.nullcontext():
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, {"extra": lambda: {"batchnorm_note": note} if note else {},
                  "params": n_params, "batchnorm": batchnorm}


def worker(args: argparse.Namespace) -> int:
    mt.limit_threads()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    info = mt.machine() if comm.rank == 0 else {}
    batches = make_batches(args.model, comm.rank, args.ids)
    make = torch_step if args.framework == "torch" else mpidl_step  # mpidl, bare
    step, meta = make(args, batches)
    c0, t0 = time.process_time(), time.perf_counter()
    times = mt.timed_windows(comm, step, args.window_s, args.windows, args.warmup_s)
    wall = time.perf_counter() - t0
    cpu = comm.allreduce(time.process_time() - c0, op=MPI.SUM)
    if comm.rank == 0:
        case = CASES[args.model]
        batch = case["batch"]
        rates = [batch * comm.size / t for t in times]
        cpu_share = cpu / (comm.size * wall)  # CPU-s per rank per wall-second
        mt.emit({"bench": "dp_train", "model": args.model, "framework": args.framework,
                 "world": comm.size, "threads_per_rank": 1, "batch_per_rank": batch,
                 "ids": args.ids if "vocab" in case else None, "params": meta["params"],
                 "batchnorm": meta["batchnorm"],
                 "samples_per_s": mt.stats(rates), "step_ms": mt.stats([1e3 * t for t in times]),
                 "cpu_s_all_ranks": cpu, "cpu_share": cpu_share,
                 "samples_per_cpu_s": statistics.median(rates) / (cpu_share * comm.size),
                 "machine": info, "mca": args.mca_note, "malloc": args.malloc,
                 **meta["extra"]()})
    if args.framework == "torch" and comm.size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, model: str, framework: str, ranks: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(ranks), "--oversubscribe"]
    for kv in args.mca:
        key, _, value = kv.partition("=")
        cmd += ["--mca", key, value]
    cmd += [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
            "--framework", framework, "--ids", args.ids, "--window-s", str(args.window_s),
            "--windows", str(args.windows), "--warmup-s", str(args.warmup_s),
            "--mca-note", " ".join(args.mca), "--malloc", args.malloc]
    if args.bucket_mb:
        cmd += ["--bucket-mb", str(args.bucket_mb)]
    if args.overlap:
        cmd += ["--overlap", args.overlap]
    if args.no_sync:
        cmd += ["--no-sync"]
    env = dict(os.environ, **mt.MPI_ENV, MPIDL_COMM="mpi", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.malloc == "keep":  # both frameworks' processes alike
        env.update(mt.MALLOC_KEEP)
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True,
                         timeout=args.timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _merge(acc: dict | None, rec: dict) -> dict:
    """Pool the windows of several rounds (median over all windows)."""
    rates = [rec["samples_per_s"]["median"]] if acc is None else \
        acc["_rates"] + [rec["samples_per_s"]["median"]]
    cpu_rates = [rec["samples_per_cpu_s"]] if acc is None else \
        acc["_cpu_rates"] + [rec["samples_per_cpu_s"]]
    best = rec["samples_per_s"]["max"] if acc is None else \
        max(acc["best"], rec["samples_per_s"]["max"])
    rec = dict(rec, _rates=rates, _cpu_rates=cpu_rates, best=best)
    rec["samples_per_s_rounds"] = mt.stats(rates)
    rec["samples_per_cpu_s_rounds"] = statistics.median(cpu_rates)
    return rec


def _fmt(r: dict | None) -> str:
    if r is None:
        return "–"
    s = r["samples_per_s_rounds"]
    if s["n"] == 1:
        s = r["samples_per_s"]
    return f"{s['median']:,.0f} ({s['min']:,.0f}–{s['max']:,.0f})"


def _best(r: dict | None) -> float:
    return r["best"] if r else float("nan")


def _med(r: dict | None) -> float:
    return r["samples_per_s_rounds"]["median"] if r else float("nan")


def _per_cpu(r: dict | None) -> float:
    return r["samples_per_cpu_s_rounds"] if r else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,bow,transformer")
    p.add_argument("--ranks", default="1,2", help="comma-separated rank counts")
    p.add_argument("--frameworks", default="mpidl,torch")
    p.add_argument("--ids", choices=("zipf", "uniform"), default="zipf")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="DataParallel bucket size (default: DataParallel's default)")
    p.add_argument("--overlap", choices=("on", "off"), default=None,
                   help="DataParallel(overlap=...): start bucket allreduces during backward "
                        "(default: DataParallel's default)")
    p.add_argument("--malloc", choices=("own", "default", "keep"), default="own",
                   help="glibc heap policy of the ranks: 'own' as each framework sets it "
                        "(DataParallel keeps freed memory, PyTorch leaves glibc's default), "
                        "'default' glibc's default for both (DataParallel(keep_freed_memory="
                        "False)), 'keep' kept for both (no per-step page faults; see "
                        "mpi_timing.MALLOC_KEEP)")
    p.add_argument("--no-sync", action="store_true",
                   help="skip the gradient exchange (DataParallel.no_sync, DDP.no_sync): "
                        "the weak-scaling ceiling of the machine itself")
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every launch, alternating the frameworks' order; the table "
                        "gives the median (min–max) of the per-launch medians")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    p.add_argument("--mca", action="append", default=[],
                   help="KEY=VALUE passed to mpiexec as --mca KEY VALUE (repeatable)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--mca-note", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    models = [m for m in args.models.split(",") if m]
    ranks = [int(n) for n in args.ranks.split(",")]
    frameworks = [f for f in args.frameworks.split(",") if f]
    if "torch" in frameworks:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            print("dp_train.py: PyTorch is not installed here (pip install torch, the CPU "
                  "build), or measure mpidl alone with --frameworks mpidl", file=sys.stderr)
            return 2
    res: dict[tuple[str, str, int], dict] = {}
    for r in range(args.rounds):
        for model in models:
            for n in ranks:
                for fw in (frameworks if r % 2 == 0 else frameworks[::-1]):
                    if (fw == "bare" and n != 1) or (fw == "torch" and "model" in CASES[model]):
                        continue  # the bare model at 1 rank only; gpt has no torch twin
                    rec = launch(args, model, fw, n)
                    print(json.dumps(rec), flush=True)
                    res[(model, fw, n)] = _merge(res.get((model, fw, n)), rec)

    loadavg = next(iter(res.values()))['machine'].get('loadavg', 0)
    ids = f"ids: {args.ids}; " if any("vocab" in CASES[m] for m in models) else ""
    print(f"\n{ids}rounds: {args.rounds}; glibc heap policy: {args.malloc}; "
          f"{'NO gradient exchange (--no-sync); ' if args.no_sync else ''}"
          f"load average at the first launch: {loadavg:.2f}")
    print("\nsamples/s: median (min–max) over launches of each launch's median window; "
          "best = the fastest window of any launch (the least disturbed by other load); "
          "per CPU-s: samples per second of all ranks' process CPU time")
    print("\n| model | ranks | mpidl samples/s | torch samples/s | mpidl / torch | ratio per CPU-s "
          "| best mpidl | best torch | best ratio | mpidl eff. (best) | torch eff. (best) "
          "| mpidl sync ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = {}
    for model in models:
        for n in ranks:
            m, t = res.get((model, "mpidl", n)), res.get((model, "torch", n))
            m1, t1 = res.get((model, "mpidl", 1)), res.get((model, "torch", 1))
            eff_m = _med(m) / (n * _med(m1)) if m and m1 else float("nan")
            eff_t = _med(t) / (n * _med(t1)) if t and t1 else float("nan")
            bm, bt, bm1, bt1 = (_best(r) for r in (m, t, m1, t1))
            wait = f"{m['comm_wait_ms']:.1f}" if m else "–"
            name = model
            if m and t and m.get("batchnorm") != t.get("batchnorm"):  # not like for like
                mark = "*" * (len(notes) + 1)
                notes[mark] = (f"{model} at {n} ranks: mpidl {m['batchnorm']} batch norm, "
                               f"torch {t['batchnorm']} ({t.get('batchnorm_note', '')})")
                name = f"{model} (torch: {t['batchnorm']} BN){mark}"
            print(f"| {name} | {n} | {_fmt(m)} | {_fmt(t)} | {_med(m) / _med(t):.2f}x | "
                  f"{_per_cpu(m) / _per_cpu(t):.2f}x | "
                  f"{bm:,.0f} | {bt:,.0f} | {bm / bt:.2f}x | {eff_m:.2f} ({bm / (n * bm1):.2f}) | "
                  f"{eff_t:.2f} ({bt / (n * bt1):.2f}) | {wait} |")
    for mark, text in notes.items():
        print(f"\n{mark} {text}")
    print_targets(res, models, ranks, args.rounds)
    return 0


def print_targets(res: dict, models: list[str], ranks: list[int], rounds: int) -> None:
    """Issue #30's ratios, per round (the launches of one round run back to back):
    mpidl's weak-scaling efficiency at each rank count, and DataParallel at 1 rank
    against the bare model (``--frameworks mpidl,bare``)."""
    def rates(model: str, fw: str, n: int) -> list[float]:
        r = res.get((model, fw, n))
        return r["_rates"] if r else []

    print("\nper round (launches back to back): mpidl weak-scaling efficiency "
          "= N-rank samples/s / (N x 1-rank samples/s); DataParallel at 1 rank / bare model")
    cols = [f"eff. {n} ranks" for n in ranks if n > 1] + ["DataParallel / bare, 1 rank"]
    print("\n| model | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for model in models:
        one = rates(model, "mpidl", 1)
        cells = []
        for n in (n for n in ranks if n > 1):
            effs = [a / (n * b) for a, b in zip(rates(model, "mpidl", n), one)]
            cells.append(", ".join(f"{e:.2f}" for e in effs) or "–")
        bare = [a / b for a, b in zip(one, rates(model, "bare", 1))]
        cells.append(", ".join(f"{e:.3f}" for e in bare) or "–")
        print(f"| {model} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
