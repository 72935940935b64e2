"""``mpidl plan``: is distributing this training worth it? Numbers before the job is queued.

For the user's model (a preset or config, as ``mpidl train`` takes) and data size, it
predicts for each rank count the step time (compute, exposed communication, input),
throughput, speedup, parallel efficiency, time to train, model-state memory per rank,
and the break-even against the hours of setting the machines up and waiting in the
queue, ending in one verdict line::

    mpidl plan --samples 50000 --epochs 3 --ranks 1,2,4,10 --network 10gbe
    mpidl plan reviews-transformer --ranks 1,2,8 --network ib-hdr --device a100 \\
        --setup-hours 40 --queue-hours 1 --json plan.json --plot plan.png
    mpidl plan --from-run runs/reviews-bow-... --ranks 1,2,4 --network mycluster

The model (strong scaling: the config's global batch, split over the ranks):

- **Compute** of one step at per-rank batch ``b`` (the largest share, ``ceil(G/R)``: the
  slowest rank sets the pace) is measured here by default: forward, backward and the
  optimizer step of the configured model on inputs of its shape, in one process with
  one BLAS thread (what a rank of a full node gets). ``--device PROFILE`` instead
  divides the step's FLOPs (about 6 per parameter per sample: forward 2, backward 4)
  by the device's sustained rate; ``--step-time S`` takes the 1-rank step at batch G as
  given and scales it as ``b / G``; ``--from-run`` uses a run's measured compute.
- **Compression** (``--compression fp16|bf16|powersgd:R``, or the config's): 16 bits
  halve every message; PowerSGD's two small allreduces per bucket are priced at their
  own sizes and its extra compute is measured here (:func:`compressed_workload`); the
  plan prints both tables and whether compression changes the verdict.
- **Communication**: the dense gradient (float32, or 16 bits with compression) in
  ``bucket_mb`` buckets, each one allreduce priced by :mod:`hpc.costmodel` on
  ``--network`` between nodes (``--node-network`` within one: ``shm``, a profile
  measured here, by default): a measured profile's own curve of time against message
  size where it has one, else its alpha-beta line. With overlap (the default across
  nodes) the buckets travel while backward (2/3 of compute) runs; the share of it they
  actually hide behind is a measured default or a run's (``--from-run``), and the
  fixed cost of a distributed step comes from a probe (``mpiexec -n 2 mpidl plan``):
  :mod:`mpidl.plan_step`. Embedding tables are counted dense: an upper bound where
  DataParallel sends touched rows only.
- **Memory** per rank: parameters, gradients and optimizer state (AdamW: two more
  copies, SGD with momentum one), in float32.
- **Modes** (:mod:`mpidl.modes`): for each rank count, data parallelism, ZeRO stages
  1-3 and, for the gpt model, tensor, Ulysses and ring parallelism: the model state per
  rank, the largest model whose state fits a rank's memory (``--memory-gb``, the
  device profile's, or this machine's memory over ``--ranks-per-node``), and the
  communication per step, from the formulas of each mode.
- **Layouts** (``mpidl plan gpt --layouts``, :mod:`mpidl.plan_layouts` over the formulas
  of :mod:`mpidl.layouts`): tensor x pipeline x data layouts of the gpt model priced from
  its shape on ``--device`` (bubble per schedule, point-to-point bytes, memory per rank
  with activations under ``--recompute`` and ``--precision``), no model built, with a
  proposal per rank count: the fastest layout that fits.
- **Break-even**: a training saves ``T(1) - T(R) - queue`` hours at R ranks; setting
  up costs ``--setup-hours`` once, so it pays after ``setup / saving`` trainings.

``--sbatch FILE`` writes the batch script (``mpidl sbatch``'s templates) for the best
rank count; ``--json FILE`` the whole table, ``--plot FILE`` speedup and time to train.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Any, Callable, Sequence

from mpidl.modes import state_bytes_per_param
from mpidl.plan_noise import run_noise_scale
from mpidl.plan_step import StepCosts, exposed_comm, shared_cores

HOUR = 3600.0


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the training is: sizes that do not depend on the rank count."""

    samples: int
    epochs: float
    global_batch: int
    params: int                  # all parameters
    grad_bytes: int              # dense gradient bytes exchanged per step (float32)
    bucket_bytes: int
    overlap: bool | None = None  # None: on across nodes, off within one (DataParallel's)
    compression: bool = False    # 16 bits on the wire (fp16, bf16)
    state_copies: int = 2        # optimizer state per parameter (AdamW: 2, SGD momentum: 1)
    # PowerSGD (compressed_workload): the bytes of each allreduce of one step's exchange,
    # the compression's own compute per step, and the steps exchanged uncompressed first
    messages: tuple[int, ...] | None = None
    extra_compute_s: float = 0.0
    uncompressed_steps: int = 0
    compressed_as: str = "none"  # how (the command line's spelling)

    @property
    def steps(self) -> int:
        return math.ceil(self.samples * self.epochs / self.global_batch)

    def overlapped(self, nodes: int) -> bool:
        """Whether the buckets overlap backward on ``nodes`` nodes (DataParallel's
        default where :attr:`overlap` is None: across nodes, not within one)."""
        return self.overlap if self.overlap is not None else nodes > 1


@dataclasses.dataclass
class Prediction:
    """One rank count's predicted step and what follows from it."""

    ranks: int
    nodes: int
    per_rank_batch: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    input_s: float
    step_s: float
    fixed_s: float
    samples_per_s: float
    speedup: float
    efficiency: float
    train_hours: float
    memory_bytes: int
    saving_hours: float = 0.0
    trainings_to_break_even: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def per_rank_batch(global_batch: int, ranks: int) -> int:
    """The largest per-rank share of a global batch (mpidl.comm.split_counts' rule)."""
    return -(-global_batch // ranks)


def check_rank_counts(ranks: Sequence[int], global_batch: int) -> None:
    """ValueError unless every rank count is >= 1 and gets a sample of each step's batch."""
    bad = [r for r in ranks if r < 1 or r > global_batch]
    if bad:
        raise ValueError(f"{bad[0]} ranks for a global batch of {global_batch}: every rank "
                         f"needs a sample per step; use at most {global_batch} ranks, or a "
                         f"larger --global-batch (at least {max(bad)})")


def comm_seconds(work: Workload, ranks: int, nodes: int, network: Any, node_link: Any) -> float:
    """Seconds of one step's gradient exchange (all buckets, not overlapped).

    Within one node the buckets cross the node's link (shared memory); across nodes the
    network's allreduce over all ranks is the bottleneck (a ring's slowest hop).
    """
    if ranks <= 1:
        return 0.0
    link = node_link if nodes <= 1 else network
    sizes = list(work.messages) if work.messages is not None else _bucket_messages(work)
    # Overlapped buckets run the non-blocking allreduce (DataParallel's default across
    # nodes): priced with its own curve where the profile has one (measured here, Open
    # MPI's over TCP took twice the blocking one's time), else the allreduce's.
    op = "iallreduce" if work.overlapped(nodes) and "iallreduce" in link.links \
        else "allreduce"
    return sum(link.time(op, n, ranks) for n in sizes)


def _bucket_messages(work: Workload) -> list[int]:
    """Bytes of each allreduce of an uncompressed (or 16-bit) exchange: full buckets."""
    wire = work.grad_bytes // 2 if work.compression else work.grad_bytes
    bucket = max(1, work.bucket_bytes // 2 if work.compression else work.bucket_bytes)
    full, rest = divmod(wire, bucket)
    return [bucket] * full + ([rest] if rest else [])


def compressed_workload(work: Workload, model: Any, choice: Any,
                        extra_compute_s: float | None = None) -> Workload:
    """``work`` with its gradients compressed as ``choice`` (a parsed ``--compression``:
    None, a wire dtype, or :class:`~mpidl.parallel.PowerSGDOptions`).

    PowerSGD's exchange is priced message by message as DataParallel sends it: per
    bucket of ``model``'s parameters (the same plan, :mod:`mpidl.parallel.buckets`), one
    allreduce of the uncompressed tensors and the Ps, one of the Qs
    (:func:`mpidl.parallel.powersgd.wire_elements`); embedding tables travel apart,
    uncompressed. Its own compute (the products, the QR, the error feedback) is
    ``extra_compute_s``, or measured here (:func:`measure_powersgd`). The first
    ``start_powerSGD_iter`` steps are priced uncompressed.
    """
    from mpidl.parallel.compression_choice import PowerSGDOptions, describe

    if choice is None:
        return work
    if not isinstance(choice, PowerSGDOptions):
        return dataclasses.replace(work, compression=True, compressed_as=describe(choice))
    shapes, tables = _bucket_shapes(model, work.bucket_bytes)
    from mpidl.parallel.powersgd import wire_elements

    messages = []
    for bucket in shapes:
        first, second = wire_elements(bucket, choice)
        messages += [4 * first] + ([4 * second] if second else [])
    messages += [4 * t for t in tables]
    if extra_compute_s is None:
        extra_compute_s = measure_powersgd(shapes, choice)
    return dataclasses.replace(work, messages=tuple(messages), extra_compute_s=extra_compute_s,
                               uncompressed_steps=int(choice.start_powerSGD_iter),
                               compressed_as=describe(choice))


def _bucket_shapes(model: Any, bucket_bytes: int) -> tuple[list[list[tuple]], list[int]]:
    """DataParallel's dense buckets of ``model`` (float32 gradients), as member shapes,
    and the element counts of the embedding tables that travel apart."""
    from mpidl.parallel.buckets import plan_buckets
    from mpidl.parallel.data import is_row_sparse

    params = model.parameters()
    tables = [p for p in params if is_row_sparse(model, p)]
    dense = [p for p in params if not any(p is t for t in tables)]
    import numpy

    groups = plan_buckets(dense, bucket_bytes, numpy.dtype("float32"))
    return ([[tuple(dense[i].data.shape) for i in g] for g in groups],
            [int(t.data.size) for t in tables])


def measure_powersgd(shapes: Sequence[Sequence[tuple]], options: Any, repeats: int = 5) -> float:
    """Seconds of PowerSGD's own compute for one step's buckets, measured here: the
    transport's exchange on one rank (where the allreduces cost nothing), float32
    gradients, the median of ``repeats`` after one warm-up."""
    import numpy

    from mpidl.comm import SingleCommunicator
    from mpidl.parallel.powersgd import PowerSGDTransport

    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency
        threadpool_limits = None
    options = dataclasses.replace(options, start_powerSGD_iter=0)
    transport = PowerSGDTransport(SingleCommunicator(), 1 << 22, options, shapes)
    rng = numpy.random.default_rng(0)
    flats = [rng.standard_normal(sum(int(numpy.prod(s)) for s in b)).astype(numpy.float32)
             for b in shapes]
    transport.bind(flats)
    times = []
    # one BLAS thread, as measure_compute (what a rank of a full node gets)
    limit = threadpool_limits(limits=1, user_api="blas") if threadpool_limits else None
    try:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            for flat in flats:
                transport.allreduce_(flat)
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        if limit is not None:
            limit.restore_original_limits()
    return statistics.median(times)


def _step(work: Workload, r: int, nodes: int, b: int, compute: Callable[[int], float],
          network: Any, node_link: Any, input_s: float,
          costs: StepCosts) -> tuple[float, float, float, float, float]:
    """One step at ``r`` ranks: (compute, communication, exposed, fixed, total) seconds."""
    extra = work.extra_compute_s if r > 1 else 0.0  # one rank compresses nothing
    c = shared_cores(compute(b) + extra, r, costs.cores)
    comm = shared_cores(comm_seconds(work, r, nodes, network, node_link), r, costs.cores)
    exposed = exposed_comm(comm, c, work.overlapped(nodes), costs.overlap_share)
    fixed = costs.fixed_s if r > 1 else 0.0
    return c, comm, exposed, fixed, c + exposed + fixed + input_s


def predict(work: Workload, compute: Callable[[int], float], ranks: Sequence[int],
            network: Any, node_link: Any, ranks_per_node: int = 1, input_s: float = 0.0,
            queue_hours: float = 0.0, setup_hours: float = 0.0,
            costs: StepCosts = StepCosts()) -> list[Prediction]:
    """The table for each rank count in ``ranks``.

    Args:
        work: the training.
        compute: seconds of one step's compute at a per-rank batch.
        ranks: the rank counts to predict (1 is added as the reference when absent).
        network: between nodes (an :class:`hpc.costmodel.NetworkProfile`).
        node_link: within a node (the same interface).
        ranks_per_node: ranks that share a node (consecutive ranks, as launchers place).
        input_s: input wait per step (0: the prefetch hides it).
        queue_hours: hours each distributed run waits in the queue (not the 1-rank run).
        setup_hours: one-off hours to set the distributed runs up.
        costs: the overlap achieved, the fixed cost of a distributed step and shared
            cores (:class:`mpidl.plan_step.StepCosts`).
    """
    counts = sorted(set(ranks) | {1})
    check_rank_counts(counts, work.global_batch)
    rows = []
    for r in counts:
        nodes = -(-r // max(1, ranks_per_node))
        b = per_rank_batch(work.global_batch, r)
        c, comm, exposed, fixed, step = _step(work, r, nodes, b, compute, network,
                                              node_link, input_s, costs)
        # PowerSGD's first steps travel uncompressed (start_powerSGD_iter)
        first = min(work.uncompressed_steps, work.steps) if r > 1 else 0
        plain = dataclasses.replace(work, messages=None, extra_compute_s=0.0)
        before = _step(plain, r, nodes, b, compute, network, node_link, input_s,
                       costs)[4] if first else 0.0
        rows.append(Prediction(
            ranks=r, nodes=nodes, per_rank_batch=b, compute_s=c, comm_s=comm,
            exposed_comm_s=exposed, input_s=input_s, step_s=step, fixed_s=fixed,
            samples_per_s=work.global_batch / step, speedup=0.0, efficiency=0.0,
            train_hours=(first * before + (work.steps - first) * step) / HOUR,
            memory_bytes=int(work.params * state_bytes_per_param("data", r, work.state_copies))))
    base = rows[0]
    for row in rows:
        row.speedup = base.step_s / row.step_s
        row.efficiency = row.speedup / row.ranks
        if row.ranks > 1:
            row.saving_hours = base.train_hours - row.train_hours - queue_hours
            row.trainings_to_break_even = (setup_hours / row.saving_hours
                                           if row.saving_hours > 0 else None)
    return [row for row in rows if row.ranks in set(ranks)] or rows[:1]


def worth_it(rows: list[Prediction], setup_hours: float, queue_hours: float) -> bool:
    """Whether :func:`verdict` says distributing is worth it (for one training)."""
    best = max(rows, key=lambda r: r.speedup)
    if best.ranks == 1 or best.saving_hours <= 0:
        return False
    return setup_hours <= 0 or (best.trainings_to_break_even or math.inf) <= 1


def compression_verdict(plain: list[Prediction], compressed: list[Prediction], how: str,
                        setup_hours: float, queue_hours: float) -> str:
    """One line: what compressing as ``how`` changes in the verdict."""
    was, now = (worth_it(rows, setup_hours, queue_hours) for rows in (plain, compressed))
    b0, b1 = (max(rows, key=lambda r: r.speedup) for rows in (plain, compressed))
    gain = (f"best {_ranks(b0.ranks)} at {b0.speedup:.2f}x uncompressed, "
            f"{_ranks(b1.ranks)} at {b1.speedup:.2f}x with {how}")
    if now and not was:
        return f"--compression {how} turns \"not worth it\" into \"worth it\": {gain}"
    if was and not now:
        return f"--compression {how} turns \"worth it\" into \"not worth it\": {gain}"
    return (f"--compression {how} does not change the verdict ("
            f"{'worth it' if now else 'not worth it'} either way): {gain}")


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def verdict(rows: list[Prediction], setup_hours: float, queue_hours: float) -> str:
    """One plain line: the best rank count, its gain, and whether it pays off."""
    base = next((r for r in rows if r.ranks == 1), None)
    best = max(rows, key=lambda r: r.speedup)
    if base is None or best.ranks == 1:
        return ("distributing does not pay: no rank count is faster than one "
                f"({_hours(base.train_hours if base else rows[0].train_hours)})")
    head = (f"{best.ranks} ranks: {best.speedup:.1f}x faster, {_hours(best.train_hours)} "
            f"instead of {_hours(base.train_hours)}")
    if best.saving_hours <= 0:
        return head + (f"; but with {queue_hours:g} h in the queue each run saves nothing: "
                       "not worth it")
    if setup_hours <= 0:
        return head + f"; saves {_hours(best.saving_hours)} per training"
    n = best.trainings_to_break_even
    when = ("pays off with the first training" if n <= 1 else
            f"pays off after {math.ceil(n)} trainings")
    worth = "worth it" if n <= 1 else "not worth it for one training"
    return head + f"; with {setup_hours:g} h of setup it {when}: {worth}"


# Below this step time the prediction leaves out what dominates. Measured here
# (benchmarks/plan_check.py, docs/planning.md "How good the predictions are"): bow's 1-1.5 ms step
# was predicted 1.2x faster at 2 ranks and ran 0.8-1.0x, from the ranks' skew each step,
# the sparse embedding gradient's exchange (0.2-0.9 ms measured against 0.03 ms priced)
# and launch-to-launch speed changes of the machine; the 40-400 ms steps of mlp and the
# transformer came within 17%.
SHORT_STEP_S = 5e-3


def caveats(rows: list[Prediction], probed: bool = False) -> list[str]:
    """What the reader of the table should know about its precision (may be empty);
    nothing about short steps once a probe measured the fixed cost (``probed``)."""
    short = [r.ranks for r in rows if r.ranks > 1 and r.step_s < SHORT_STEP_S and not probed]
    if not short:
        return []
    return [f"the step at {', '.join(map(str, short))} ranks is under "
            f"{SHORT_STEP_S * 1e3:g} ms: per-step overheads this prediction leaves out (the "
            "ranks' skew, a sparse gradient's exchange) dominate there, so it is optimistic "
            "(measured: a 1 ms step predicted 1.2x faster at 2 ranks ran 0.8-1.0x); probe "
            "them: run the plan under mpiexec -n 2 (or more)"]


def time_unit(hours: float) -> tuple[str, float]:
    """The unit to show a time of ``hours`` in, and how many of it make an hour: ``("s",
    3600)`` under a minute, ``("min", 60)`` under an hour, ``("h", 1)`` under two days,
    else ``("days", 1 / 24)``. For several times (a plot's axis), pass the longest."""
    if hours < 1 / 60:
        return "s", 3600
    if hours < 1:
        return "min", 60
    return ("h", 1) if hours < 48 else ("days", 1 / 24)


def _hours(h: float) -> str:
    unit, per_hour = time_unit(h)
    return f"{h * per_hour:.0f} {unit}" if per_hour > 1 else f"{h * per_hour:.1f} {unit}"


def format_table(rows: list[Prediction]) -> str:
    """The human-readable table (milliseconds per step, hours to train)."""
    head = (f"{'ranks':>5} {'nodes':>5} {'batch/rank':>10} {'compute ms':>10} "
            f"{'comm ms':>8} {'exposed ms':>10} {'fixed ms':>8} {'step ms':>8} {'samples/s':>10} "
            f"{'speedup':>7} {'eff':>5} {'train h':>8} {'state MB':>8}")
    lines = [head]
    for r in rows:
        lines.append(f"{r.ranks:5d} {r.nodes:5d} {r.per_rank_batch:10d} "
                     f"{r.compute_s * 1e3:10.2f} {r.comm_s * 1e3:8.2f} "
                     f"{r.exposed_comm_s * 1e3:10.2f} {r.fixed_s * 1e3:8.2f} {r.step_s * 1e3:8.2f} "
                     f"{r.samples_per_s:10.0f} {r.speedup:7.2f} {r.efficiency:5.2f} "
                     f"{r.train_hours:8.3f} {r.memory_bytes / 1e6:8.1f}")
    return "\n".join(lines)


# -- the model and its compute -------------------------------------------------------------

def data_dir_for(config: Any) -> str:
    """The run's dataset directory: ``--data``'s, or the task's generated corpus, made
    and cached as `mpidl train` would (once): the model's shapes and the measured
    batches come from the real data (the corpus's vocabulary is far below
    ``vocab_size``)."""
    from mpidl.comm import SingleCommunicator
    from mpidl.train.log import Logger
    from mpidl.train.task import prepare_data

    return prepare_data(config, SingleCommunicator(), Logger())


def workload(config: Any, model: Any, samples: int, epochs: float) -> Workload:
    """The training's sizes from the config and the built model."""
    params = model.parameters()
    count = sum(int(p.data.size) for p in params)
    bucket_mb = config.bucket_mb if config.bucket_mb is not None else 4.0
    momentum = 1 if config.momentum else 0
    copies = {"adamw": 2, "adam": 2, "lamb": 2, "sgd": momentum,
              "lars": 1}[config.optimizer]  # state arrays per parameter
    return Workload(samples=samples, epochs=epochs, global_batch=config.global_batch,
                    params=count, grad_bytes=4 * count, bucket_bytes=int(bucket_mb * 2**20),
                    overlap=config.overlap, state_copies=copies)


def measure_compute(config: Any, data_dir: str, batches: Sequence[int], repeats: int = 7
                    ) -> dict[int, float]:
    """Seconds of one training step at each per-rank batch size, measured here: the
    step ``mpidl train`` runs (:class:`mpidl.train.step.TrainStep` of a run built by
    :func:`mpidl.train.build.build_run` on one rank: the objective's forward and loss,
    backward through DataParallel with its sparse embedding update, the finite-step
    guard, clipping, the optimizer) on the run's own data, with one BLAS thread, the
    median of ``repeats`` after two warm-up steps. Nothing is written: no run directory.

    Measured on a 1 ms step (bow), the guard, the schedule and the loss bookkeeping are
    a fifth of the step: timing the bare forward/backward/optimizer instead predicted
    bow 20% fast at 1 rank. The median, not the fastest: a run's steps are as disturbed
    as these are, and bow's fastest of 7 was 12% below its median of 300 (the mean of
    300 was 3% above the median; the slowest of 2 ranks' steps, the expected maximum
    of two draws, 6% above: left out).
    """
    # Here, not at the top: `mpidl plan --help` and the cost model answer without
    # NumPy and the whole training stack.
    import numpy

    from mpidl.comm import SingleCommunicator
    from mpidl.train.build import build_run
    from mpidl.train.step import TrainStep

    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency
        threadpool_limits = None
    run = build_run(config, SingleCommunicator(), data_dir)
    step = TrainStep(run)
    limit = threadpool_limits(limits=1, user_api="blas") if threadpool_limits else None
    rng = numpy.random.default_rng(0)
    features = run.objective.features
    out = {}
    try:
        for b in sorted(set(batches)):
            ids = numpy.sort(rng.choice(len(run.train_set), size=b,
                                        replace=len(run.train_set) < b))
            arrays = [run.train_set.read(name, ids) for name in features]
            x, y = arrays[0], arrays[1] if len(arrays) > 1 else None
            times = []
            for i in range(repeats + 2):  # two warm-up steps
                t0 = time.perf_counter()
                step(x, y, b, 0)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            out[b] = statistics.median(times)
    finally:
        run.close()
        if limit is not None:
            limit.restore_original_limits()
    return out


def compute_from_run(run_dir: str) -> tuple[Callable[[int], float], float, dict]:
    """A run's measured compute per sample (and input wait) from its ``metrics.jsonl``,
    and its gradient noise scale where it measured one (:mod:`mpidl.plan_noise`)."""
    from mpidl.train.config import load_config
    from mpidl.train.metrics import read_metrics

    records = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
               if r.get("kind") == "train" and "time_compute" in r]
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no train records with step times: "
                         "train first (any length), then plan from it")
    config = load_config(os.path.join(run_dir, "config.toml"))
    tail = records[len(records) // 2:]  # after warm-up
    compute = sum(r["time_compute"] for r in tail) / len(tail)
    input_s = sum(r.get("time_input", 0.0) for r in tail) / len(tail)
    waited = statistics.median(r.get("time_comm", 0.0) for r in tail)
    ranks = _run_ranks(run_dir)
    b = per_rank_batch(config.global_batch, ranks)
    noise = run_noise_scale(read_metrics(os.path.join(run_dir, "metrics.jsonl")))
    return (lambda batch: compute * batch / b), input_s, {
        "ranks": ranks, "config": config, "per_rank": b, "noise_scale": noise,
        "compute_s": compute, "comm_wait_s": waited}


def _run_ranks(run_dir: str) -> int:
    from mpidl.train.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(os.path.join(run_dir, "checkpoints"))
    return int(load_checkpoint(path, "none").extra.get("ranks", 1)) if path else 1


def shared_memory_link() -> Any:
    """The link between ranks of this node (its shared memory), measured here: two
    threads are not MPI, so a memory copy's bandwidth and a fixed few microseconds per
    step stand in (Open MPI's shared-memory latency)."""
    import numpy

    from hpc.costmodel import Link, NetworkProfile

    a = numpy.ones(8 * 2**20 // 8)
    b = numpy.empty_like(a)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        numpy.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    # A shared-memory reduction reads two copies and writes one: a third of a copy's rate.
    bandwidth = a.nbytes / best / 3
    return NetworkProfile("shm", "measured here: numpy copy bandwidth / 3, 2 us per step",
                          {"default": Link(2e-6, bandwidth)})


_UNIT_WORDS = {"s": "seconds", "min": "minutes", "h": "hours", "days": "days"}


def figure(rows: list[Prediction], title: str) -> Any:
    """The matplotlib Figure of :func:`plot`: speedup (with the ideal line) and time to
    train against ranks, the time in the unit its longest value reads best in."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax_s, ax_t = fig.subplots(1, 2)
    r = [row.ranks for row in rows]
    ax_s.plot(r, [row.speedup for row in rows], marker="o", label="predicted")
    ax_s.plot(r, r, linestyle="--", color="grey", label="ideal")
    ax_s.set(xlabel="ranks", ylabel="speedup", title=title)
    unit, per_hour = time_unit(max(row.train_hours for row in rows))
    ax_t.plot(r, [row.train_hours * per_hour for row in rows], marker="o")
    ax_t.set(xlabel="ranks", ylabel=f"{_UNIT_WORDS[unit]} to train", title="time to train")
    for ax in (ax_s, ax_t):
        ax.grid(True, alpha=0.3)
    ax_s.legend()
    fig.tight_layout()
    return fig


def plot(rows: list[Prediction], path: str, title: str) -> str:
    """Speedup (with the ideal line) and time to train against ranks, into ``path``."""
    figure(rows, title).savefig(path, dpi=110)
    return path
