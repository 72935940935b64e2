"""Peak memory per rank of resuming a gpt model: data parallel against ZeRO-3 (issue #24).

One launch writes a sharded checkpoint of a float32 gpt model (56 M parameters by
default) after one AdamW step; then one launch per mode resumes it as ``mpidl train``
does (build the model, the wrapper and the optimizer, choose the checkpointer, read the
index, load this rank's share) and reports each rank's peak resident memory (the
process's ``ru_maxrss``: imports, the model's construction and the load, all of it) and
the state the rank holds afterwards. ``--old`` resumes as mpidl did before sharded
checkpoints (every rank assembles the whole checkpoint, then keeps its share)::

    .venv/bin/python benchmarks/resume_memory.py                 # 4 ranks, dp and zero3
    .venv/bin/python benchmarks/resume_memory.py --old --ranks 4 --layers 2

Prints one JSON line per launch, then a markdown table (results: benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build(args, mode, comm):
    """The model, wrapper and optimizer of ``mode`` ("dp" or "zero3") on this rank."""
    from mpidl.models import gpt
    from mpidl.optim import AdamW
    from mpidl.parallel import DataParallel, ShardedDataParallel

    model = gpt(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, layers=args.layers,
                heads=args.heads, seed=0, dtype="float32")
    wrapper = (ShardedDataParallel(model, comm, stage=3, keep_freed_memory=False)
               if mode == "zero3" else DataParallel(model, comm, keep_freed_memory=False))
    return model, wrapper, AdamW(wrapper.parameters(), lr=1e-4)


def worker(args) -> None:
    from mpidl.comm import world

    comm = world()
    start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if args.worker == "save":
        import numpy

        from mpidl.train.checkpointer import choose_checkpointer

        model, wrapper, opt = build(args, "zero3", comm)
        for s in wrapper.parameters():  # one step from a small gradient: Adam's state
            s.grad = numpy.full_like(s.data, 1e-3)
        opt.step()
        choose_checkpointer(comm, None, wrapper, model, opt).save(args.dir, 1, rng={},
                                                                  sampler={})
        report = {"parameters": sum(p.size for p in model.parameters())
                  if args.mode != "zero3" else None}
    else:
        from mpidl.train import checkpoint as ckpt

        path = os.path.join(args.dir, ckpt.checkpoint_name(1))
        model, wrapper, opt = build(args, args.mode, comm)
        if args.old:  # as before #24: the whole checkpoint on every rank, then a share
            state = ckpt.load_checkpoint(path)
            if args.mode == "zero3":
                from mpidl.parallel.zero_state import load_full_state

                load_full_state(wrapper, state.model, state.optimizer, opt)
            else:
                model.load_state_dict(state.model)
                opt.load_state_dict(state.optimizer)
            del state
        else:
            from mpidl.train.checkpointer import choose_checkpointer

            choose_checkpointer(comm, None, wrapper, model, opt).load(
                ckpt.load_checkpoint(path, "none"))
        from mpidl.train.memory import state_bytes

        report = {"held": sum(state_bytes(wrapper, opt).values())}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    everyone = comm.allgather_obj({"peak_rss": peak * 1024, "import_rss": start * 1024,
                                   "seconds": time.perf_counter() - t0, **report})
    if comm.rank == 0:
        print(json.dumps({"worker": args.worker, "mode": args.mode, "old": args.old,
                          "ranks": comm.size, "per_rank": everyone}), flush=True)


def launch(args, *extra) -> dict:
    cmd = ["mpiexec", "--oversubscribe", "-n", str(args.ranks), sys.executable, __file__,
           *extra, "--dir", args.dir, "--vocab", str(args.vocab), "--dim", str(args.dim),
           "--layers", str(args.layers), "--heads", str(args.heads),
           "--seq-len", str(args.seq_len)]
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd[0] = mpiexec if os.path.exists(mpiexec) else "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    line = [l for l in out.stdout.splitlines() if l.startswith("{")][-1]
    print(line, flush=True)
    return json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--old", action="store_true", help="also resume the pre-#24 way")
    parser.add_argument("--worker", choices=("save", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="dp", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="mpidl-resume-") as args.dir:
        launch(args, "--worker", "save", "--mode", "zero3")
        rows = []
        for old in ([False, True] if args.old else [False]):
            for mode in ("dp", "zero3"):
                r = launch(args, "--worker", "resume", "--mode", mode,
                           *(["--old"] if old else []))
                rows.append((mode, old, max(p["peak_rss"] for p in r["per_rank"]),
                             max(p["held"] for p in r["per_rank"])))
    from mpidl.models import gpt

    n = gpt(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, layers=args.layers,
            heads=args.heads, seed=0).num_parameters()
    mib = 2 ** 20
    print(f"\ngpt {n / 1e6:.1f} M parameters, float32, AdamW, {args.ranks} ranks\n")
    print("| resume | peak RSS per rank (max) | state held per rank | vs data parallel |")
    print("|---|---|---|---|")
    for mode, old, peak, held in rows:
        dp = next(p for m, o, p, _ in rows if m == "dp" and o == old)
        print(f"| {mode}{' (before #24)' if old else ''} | {peak / mib:.0f} MiB | "
              f"{held / mib:.0f} MiB | {peak / dp:.0%} |")


if __name__ == "__main__":
    main()
