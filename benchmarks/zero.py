"""ZeRO stages against data parallelism, PyTorch's ZeroRedundancyOptimizer and FSDP.

Per model (the reference transformer, and the `gpt` preset's model) and mode (mpidl
DataParallel, ShardedDataParallel stage 1, 2, 3; PyTorch DDP, DDP with
ZeroRedundancyOptimizer, and FSDP2's ``fully_shard`` per layer, on gloo), one
``mpiexec`` launch at 2 ranks: AdamW, float32, synthetic batches, warm-up, timed
windows (the slowest rank's), one thread per rank.
Reports samples/s, the ratio to mpidl's DataParallel, the model state each rank holds
(parameters + gradients + optimizer state, from the arrays) and the peak of the memory
Python allocated during the steps (tracemalloc; NumPy's arrays included; for PyTorch,
the process's peak RSS growth instead, since its tensors bypass tracemalloc)::

    .venv/bin/python benchmarks/zero.py                     # both models, all modes
    .venv/bin/python benchmarks/zero.py --models gpt --modes dp,zero3

Prints one JSON line per launch, then a markdown table.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402

import numpy  # noqa: E402

import mpi_timing as mt  # noqa: E402

CASES = {
    "transformer": {"batch": 32, "kind": "classifier"},
    "gpt": {"batch": 32, "kind": "lm"},
}
MODES = ("dp", "zero1", "zero2", "zero3", "torch-ddp", "torch-zero", "torch-fsdp")


def _mpidl_model(name: str):
    import mpidl.models as models

    if name == "gpt":
        return models.gpt(vocab=64, seq_len=32, dim=64, layers=2, heads=4, seed=0)
    return models.build("transformer", seed=0)


def _batches(name: str, rank: int) -> list:
    rng = numpy.random.default_rng(100 + rank)
    if name == "gpt":
        return [(rng.integers(0, 64, size=(32, 32)), None) for _ in range(4)]
    return [(rng.integers(0, 8000, size=(32, 128)), rng.integers(0, 2, size=32))
            for _ in range(4)]


def mpidl_step(args, batches):
    import tracemalloc

    import mpidl.comm
    from mpidl import functions as F
    from mpidl.optim import AdamW
    from mpidl.parallel import DataParallel, ShardedDataParallel
    from mpidl.train.memory import state_bytes

    comm = mpidl.comm.world()
    model = _mpidl_model(args.model)
    if args.mode == "dp":
        wrapper = DataParallel(model, comm, keep_freed_memory=True)  # as mpidl train
    else:
        wrapper = ShardedDataParallel(model, comm, stage=int(args.mode[-1]),
                                      keep_freed_memory=True)
    opt = AdamW(wrapper.parameters(), lr=1e-3)
    state = {"i": 0}

    def loss_of(x, y):
        if y is None:  # language model: predict the next token
            logits = wrapper(x[:, :-1])
            return F.softmax_cross_entropy(logits, x[:, 1:], reduction="sum"), x[:, 1:].size
        return F.softmax_cross_entropy(wrapper(x), y, reduction="sum"), len(y)

    def step() -> None:
        x, y = batches[state["i"] % len(batches)]
        state["i"] += 1
        loss, count = loss_of(x, y)
        wrapper.backward(loss, global_count=count * comm.size)
        opt.step()
        opt.zero_grad()

    step()
    tracemalloc.start()
    step()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    held = state_bytes(wrapper, opt)

    def extra():
        return {"state_bytes": held, "peak_step_bytes": peak}

    return step, extra


def torch_step(args, batches):
    import resource

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    dist.init_process_group("gloo", init_method="env://")
    if args.model == "gpt":
        layer = torch.nn.TransformerEncoderLayer(64, 4, 256, 0.0, batch_first=True,
                                                 norm_first=True)
        body = torch.nn.Sequential(torch.nn.Embedding(64, 64),
                                   torch.nn.TransformerEncoder(layer, 2),
                                   torch.nn.LayerNorm(64), torch.nn.Linear(64, 64))
    else:
        from engine import torch_model

        body = torch_model("transformer")
    if args.mode == "torch-fsdp":
        # FSDP2 (fully_shard; runs on CPU over gloo): each transformer layer a unit, as
        # mpidl's stage 3 makes each ModuleList block one, then the rest at the root.
        from torch.distributed.fsdp import fully_shard

        layers = body[1].layers if args.model == "gpt" else body.layers
        for layer in layers:
            fully_shard(layer)
        model = fully_shard(body)
    else:
        model = torch.nn.parallel.DistributedDataParallel(body)
    if args.mode == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tensors = [(torch.from_numpy(x), None if y is None else torch.from_numpy(y))
               for x, y in batches]
    state = {"i": 0}

    def step() -> None:
        x, y = tensors[state["i"] % len(tensors)]
        state["i"] += 1
        if y is None:
            out = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, 64), x[:, 1:].reshape(-1))
        else:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    step()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    if args.mode == "torch-fsdp":  # DTensor parameters: this rank's shards, as held
        n = sum(p.to_local().numel() for p in model.parameters())
        # gradients: reduce-scattered into shards, then freed by zero_grad(set_to_none)
        # between steps, as mpidl's stage 3 frees its shards' (both report 0 held)
        params, grads = 4 * n, 0
        shard = 1  # n is the shard already
    else:
        n = sum(p.numel() for p in model.parameters())
        params, grads = 4 * n, 4 * n
        shard = 1 if args.mode == "torch-ddp" else int(os.environ["WORLD_SIZE"])

    def extra():
        return {"state_bytes": {"parameters": params, "gradients": grads,
                                "optimizer": 8 * n // shard},
                "peak_step_bytes": grown, "peak_note": "RSS growth over two steps"}

    return step, extra


def worker(args) -> int:
    mt.limit_threads()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    batches = _batches(args.model, comm.rank)
    step, extra = (torch_step if args.mode.startswith("torch") else mpidl_step)(args, batches)
    times = mt.timed_windows(comm, step, args.window_s, args.windows, args.warmup_s)
    if comm.rank == 0:
        rates = [CASES[args.model]["batch"] * comm.size / t for t in times]
        mt.emit({"bench": "zero", "model": args.model, "mode": args.mode, "world": comm.size,
                 "samples_per_s": mt.stats(rates), **extra(), "machine": mt.machine()})
    return 0


def launch(args, model: str, mode: str) -> dict | None:
    from mpidl.testing.launch import launch_env, mpiexec_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = launch_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cmd = mpiexec_command(args.ranks, [sys.executable, os.path.abspath(__file__), "--worker",
                                       "--model", model, "--mode", mode,
                                       "--window-s", str(args.window_s),
                                       "--windows", str(args.windows),
                                       "--warmup-s", str(args.warmup_s)])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"# {model} {mode} failed: {done.stderr[-800:]}", file=sys.stderr)
        return None
    print(lines[-1], flush=True)
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="transformer,gpt")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    modes = args.modes.split(",")
    try:
        import torch  # noqa: F401
    except ImportError:
        modes = [m for m in modes if not m.startswith("torch")]
        print("# PyTorch is not installed: its modes are left out", file=sys.stderr)
    rows = []
    for model in args.models.split(","):
        base = None
        for mode in modes:
            rec = launch(args, model, mode)
            if rec is None:
                continue
            rate = rec["samples_per_s"]["median"]
            base = rate if mode == "dp" else base
            rows.append((model, mode, rate, rate / base if base else float("nan"), rec))
    print("\n| model | mode | samples/s | vs mpidl DP | state per rank MB (params + grads + "
          "optimizer) | peak during a step MB |\n|---|---|---|---|---|---|")
    for model, mode, rate, ratio, rec in rows:
        s = rec["state_bytes"]
        total = (s["parameters"] + s["gradients"] + s["optimizer"]) / 1e6
        print(f"| {model} | {mode} | {rate:.0f} | {ratio:.2f}x | {total:.2f} "
              f"({s['parameters'] / 1e6:.2f} + {s['gradients'] / 1e6:.2f} + "
              f"{s['optimizer'] / 1e6:.2f}) | {rec['peak_step_bytes'] / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
