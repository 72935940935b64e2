"""Tensor and sequence parallelism against data parallelism on the small GPT.

Runs under a launcher, one thread per rank::

    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python benchmarks/model_parallel.py
    OMP_NUM_THREADS=1 mpiexec -n 2 .venv/bin/python benchmarks/model_parallel.py \
        --seq-len 256 --batch 4 --windows 5 --json runs/model-parallel.json

Four measurements, every mode on the same ``gpt`` (``--vocab --seq-len --dim --layers
--heads``, float32) and the same global batch (``--batch`` samples per rank under data
parallelism; the tensor or sequence group of the other modes processes all of them
together):

1. **throughput**: samples/s of a training step (forward, backward, gradient averaging
   over the replicas, AdamW) for data, tensor, tensor + Megatron sequence, Ulysses and
   ring parallelism, each as a ratio to data parallelism; median and range over
   ``--windows`` windows of ``--steps`` steps, modes interleaved window by window (the
   machine is shared: compare ratios, not absolute numbers);
2. **bytes per layer** per rank, counted by :class:`~mpidl.testing.counting.CountingCommunicator`
   (a 2-layer minus a 1-layer model, forward and backward), next to the formulas of
   docs/model-parallel.md;
3. **the ring's overlap**: the time ring attention's forward (and backward) spends
   blocked in ``wait()`` on its K/V (and dK/dV) exchanges, against the time the same
   exchanges take back to back with nothing to overlap; the hidden share is
   ``1 - blocked / alone``. A wait also absorbs the neighbour's lateness (its compute,
   or the OS descheduling it), so on a loaded machine the share is a lower bound;
4. **memory**: peak traced bytes per rank (:func:`mpidl.testing.memory.peak_bytes`) of
   one attention forward + backward by sequence group size, of a whole training step's
   forward + backward by mode (and of the plain GPT on the whole global batch in one
   process), and the parameter bytes per rank.

The ring's numbers are medians (and ranges) over ``--windows x --steps`` repetitions.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402

MODES = {  # name -> (tensor, sequence, options), for a world of n ranks
    "data": lambda n: (1, 1, {}),
    "tensor": lambda n: (n, 1, {}),
    "tensor+sp": lambda n: (n, 1, {"sequence_parallel": True}),
    "ulysses": lambda n: (1, n, {"attention": "ulysses"}),
    "ring": lambda n: (1, n, {"attention": "ring"}),
}


def model_kwargs(args: argparse.Namespace, layers: int | None = None) -> dict:
    return dict(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim,
                layers=args.layers if layers is None else layers, heads=args.heads, seed=0,
                dtype="float32")


class Run:
    """One mode's model, optimizer and data-parallel wrapper, ready to step."""

    def __init__(self, comm, mode: str, args: argparse.Namespace) -> None:
        from mpidl.optim import AdamW
        from mpidl.parallel import DataParallel, ProcessGrid, parallel_gpt

        tensor, sequence, options = MODES[mode](comm.size)
        self.grid = ProcessGrid(comm, tensor=tensor, sequence=sequence)
        self.model = parallel_gpt(self.grid, **options, **model_kwargs(args))
        self.dp = DataParallel(self.model, self.grid.replicas, keep_freed_memory=True)
        self.opt = AdamW(self.model.parameters(), lr=1e-3)
        rng = numpy.random.default_rng(1)
        global_batch = args.batch * comm.size
        self.ids = rng.integers(0, args.vocab, (global_batch, args.seq_len + 1))
        rows = numpy.array_split(numpy.arange(global_batch), self.grid.data_size)
        self.mine = self.ids[rows[self.grid.data_rank]]
        self.n = self.model.count_targets(self.ids)
        self.global_batch = global_batch

    def step(self) -> None:
        self.dp.backward(self.model.loss(self.mine), global_count=self.n)
        self.opt.step()
        self.opt.zero_grad()

    def close(self) -> None:
        self.dp.close()
        self.grid.free()


def throughput(comm, args: argparse.Namespace) -> dict:
    runs = {mode: Run(comm, mode, args) for mode in MODES}
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode, run in runs.items():  # warm-up
        for _ in range(args.warmup):
            run.step()
    for _ in range(args.windows):
        for mode, run in runs.items():
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                run.step()
            elapsed = max(comm.allgather_obj(time.perf_counter() - t0))  # the slowest rank
            rates[mode].append(run.global_batch * args.steps / elapsed)
    for run in runs.values():
        run.close()
    out = {}
    for mode, r in rates.items():
        ratios = [a / b for a, b in zip(r, rates["data"])]
        out[mode] = {"samples_per_s": statistics.median(r), "min": min(r), "max": max(r),
                     "ratio_to_data": statistics.median(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios)}
    return out


def bytes_per_layer(comm, args: argparse.Namespace) -> dict:
    from mpidl.parallel import ProcessGrid, parallel_gpt
    from mpidl.parallel.sequence import SequenceLayout
    from mpidl.testing.counting import CountingCommunicator

    b, t, d, f4 = args.batch * comm.size, args.seq_len, args.dim, 4
    n = comm.size

    def counted(mode: str, layers: int) -> dict:
        tensor, sequence, options = MODES[mode](n)
        world = CountingCommunicator(comm)
        grid = ProcessGrid(world, tensor=tensor, sequence=sequence)
        model = parallel_gpt(grid, **options, **model_kwargs(args, layers))
        ids = numpy.random.default_rng(0).integers(0, args.vocab, (b, t + 1))
        grid.tensor.reset()
        grid.sequence.reset()
        model.loss(ids).backward()
        total = grid.tensor.total().nbytes + grid.sequence.total().nbytes
        calls = grid.tensor.total().calls + grid.sequence.total().calls
        grid.free()
        return {"bytes": total, "calls": calls}

    ring_shard = SequenceLayout(t, n, zigzag=True).shard_length
    theory = {  # per layer and rank, forward + backward (docs/model-parallel.md)
        "data": 0,
        "tensor": 4 * b * t * d * f4,
        "tensor+sp": (4 * b * t * d + 6 * b * t * d // n + 6 * d) * f4,
        "ulysses": 8 * b * (t // n) * d * f4,
        "ring": (3 * n - 2) * 2 * b * ring_shard * d * f4,
    }
    out = {}
    for mode in MODES:
        one, two = counted(mode, 1), counted(mode, 2)
        out[mode] = {"measured": two["bytes"] - one["bytes"], "calls": two["calls"] - one["calls"],
                     "theory": theory[mode]}
    return out


class _Timed:
    """A request whose ``wait()`` adds the time it blocked to ``clock[0]``."""

    def __init__(self, req, clock: list) -> None:
        self.req, self.clock = req, clock

    def test(self) -> bool:
        return self.req.test()

    def wait(self):
        t0 = time.perf_counter()
        out = self.req.wait()
        self.clock[0] += time.perf_counter() - t0
        return out


def ring_overlap(comm, args: argparse.Namespace) -> dict:
    from mpidl import functions as F
    from mpidl.autograd import Tensor
    from mpidl.nn.attention import merge_heads, split_heads
    from mpidl.parallel.ring import ring_attention
    from mpidl.parallel.sequence import SequenceLayout
    from mpidl.testing.counting import CountingCommunicator

    if comm.size == 1:
        return {}
    clock = [0.0]

    class TimedRing(CountingCommunicator):
        def isendrecv(self, x, dest, source):
            return _Timed(super().isendrecv(x, dest, source), clock)

    seq = TimedRing(comm)
    b, t, h, dh = args.batch, args.seq_len, args.heads, args.dim // args.heads
    layout = SequenceLayout(t, comm.size, comm.rank, zigzag=True)
    qkv = layout.split(numpy.random.default_rng(0).standard_normal(
        (b, t, 3 * h * dh)).astype(numpy.float32))
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    buf = numpy.zeros((b, h, layout.shard_length, 2 * dh), numpy.float32)  # one K/V block

    def alone(n: int) -> float:
        """Seconds for ``n`` block exchanges back to back, nothing to overlap with."""
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            comm.sendrecv(buf, right, left)
        return time.perf_counter() - t0

    rows = []  # (forward ms, blocked, alone; backward ms, blocked, alone)
    for _ in range(args.windows * args.steps):
        x = Tensor(qkv, requires_grad=True)
        clock[0] = 0.0
        comm.barrier()
        t0 = time.perf_counter()
        y = merge_heads(ring_attention(*split_heads(x, h), seq, layout, causal=True))
        t1, fwd_blocked = time.perf_counter(), clock[0]
        F.sum(y).backward()
        t2 = time.perf_counter()
        # Forward passes s-1 K/V blocks; backward s-1 again and s dK/dV blocks.
        rows.append((t1 - t0, fwd_blocked, alone(comm.size - 1),
                     t2 - t1, clock[0] - fwd_blocked, alone(2 * comm.size - 1)))
    out = {}
    for i, name in ((0, "forward"), (3, "backward")):
        hidden = [max(0.0, 1 - r[i + 1] / r[i + 2]) for r in rows]
        out[name] = {"attention_ms": 1e3 * statistics.median(r[i] for r in rows),
                     "blocked_ms": 1e3 * statistics.median(r[i + 1] for r in rows),
                     "exchanges_alone_ms": 1e3 * statistics.median(r[i + 2] for r in rows),
                     "hidden_share": statistics.median(hidden),
                     "hidden_quartiles": statistics.quantiles(hidden, n=4)[::2]}
    return out


def memory(comm, args: argparse.Namespace) -> dict:
    from mpidl import functions as F
    from mpidl.autograd import Tensor
    from mpidl.nn.attention import merge_heads, split_heads
    from mpidl.parallel import ProcessGrid
    from mpidl.parallel.ring import ring_attention
    from mpidl.parallel.sequence import SequenceLayout, ulysses_attention
    from mpidl.testing.memory import peak_bytes

    out: dict = {"attention": {}, "step": {}}
    b, t, h, dh = args.batch, args.seq_len, args.heads, args.dim // args.heads
    full = numpy.random.default_rng(0).standard_normal((b, t, 3 * h * dh)).astype(numpy.float32)
    for s in [s for s in range(1, comm.size + 1) if comm.size % s == 0]:
        grid = ProcessGrid(comm, sequence=s)
        seq = grid.sequence
        for mode in ("ring", "ulysses"):
            layout = SequenceLayout(t, s, seq.rank, zigzag=(mode == "ring"))
            qkv = layout.split(full)

            def run():
                x = Tensor(qkv, requires_grad=True)
                if mode == "ring":
                    y = merge_heads(ring_attention(*split_heads(x, h), seq, layout, True))
                else:
                    y = ulysses_attention(x, seq, h, True, layout)
                F.sum(y).backward()

            if mode == "ulysses" and h % s:
                continue
            peak = max(comm.allgather_obj(peak_bytes(run)[1]))
            out["attention"][f"{mode}, s={s}"] = peak
        grid.free()
    from mpidl.models import gpt

    single = gpt(**model_kwargs(args))  # one process, the whole global batch, no exchange
    ids = numpy.random.default_rng(1).integers(0, args.vocab,
                                               (args.batch * comm.size, args.seq_len + 1))
    single.loss(ids).backward()
    out["step"]["1 process"] = peak_bytes(lambda: single.loss(ids).backward())[1]
    out["parameters"] = {"1 process": sum(p.data.nbytes for p in single.parameters())}
    for mode in MODES:
        run = Run(comm, mode, args)
        run.step()  # gradients and optimizer state exist from here on
        _, peak = peak_bytes(lambda: run.model.loss(run.mine).backward())
        out["step"][mode] = max(comm.allgather_obj(peak))
        out["parameters"][mode] = max(comm.allgather_obj(
            sum(p.data.nbytes for p in run.model.parameters())))
        run.model.zero_grad()
        run.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="samples per rank under data parallelism")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--only", default="throughput,bytes,overlap,memory")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    args = p.parse_args()

    import mpidl.comm

    comm = mpidl.comm.world()
    parts = {"throughput": throughput, "bytes": bytes_per_layer, "overlap": ring_overlap,
             "memory": memory}
    results = {"ranks": comm.size, "config": vars(args)}
    for name in args.only.split(","):
        results[name] = parts[name](comm, args)
        if comm.rank == 0:
            print(f"== {name}", json.dumps(results[name], indent=1), flush=True)
    if comm.rank == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
