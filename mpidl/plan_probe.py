"""The planner's probe: a few real distributed steps, for the fixed cost of being distributed.

``mpiexec -n 2 mpidl plan [PRESET] ...`` runs it before rank 0 plans: every rank builds
the run as ``mpidl train`` would (DataParallel over the launched ranks, the run's own
data), takes :data:`PROBE_STEPS` training steps on its share of the global batch after
:data:`WARMUP_STEPS`, and the median step, the slowest rank's, goes to the planner.
What that step took beyond the single-process compute and the priced exchange is the
fixed cost (:func:`mpidl.plan_step.fixed_cost`): the ranks' skew, the step's small
agreement allreduces, a sparse gradient's exchange and per-step Python, all of which
the alpha-beta model leaves out and which decide a step of a millisecond or two (#30).

The probe times the step the trainer runs (:class:`mpidl.train.step.TrainStep`), with
one BLAS thread per rank, like the compute the planner measures; nothing is written.
Why 30 steps: bow's 2-rank step is ~1.5-2 ms, so 30 steps are ~50 ms of probing, and
its median moved by ~5% between launches here, less than launch-to-launch changes of
the machine itself (docs/planning.md); a transformer's 30 steps take ~7 s.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

PROBE_STEPS = 30
WARMUP_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Probe:
    """A probe's result: the median distributed step at ``ranks`` ranks on ``nodes``
    nodes, each rank's share of the global batch at most ``per_rank_batch``."""

    ranks: int
    nodes: int
    per_rank_batch: int
    step_s: float
    steps: int


def probe_step(comm: Any, config: Any, data_dir: str, steps: int = PROBE_STEPS) -> Probe:
    """Time ``steps`` training steps of ``config`` on ``comm``'s ranks. Collective.

    Every rank draws the same global batch of ``config.global_batch`` sample ids (a
    fixed seed: the step's cost, not its learning, is measured) and trains on its
    share (:func:`mpidl.comm.split_counts`), as the trainer's sampler splits it.
    """
    import numpy

    from mpidl.comm import split_counts
    from mpidl.train.build import build_run
    from mpidl.train.step import TrainStep

    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency
        threadpool_limits = None
    run = build_run(config, comm, data_dir)
    limit = threadpool_limits(limits=1, user_api="blas") if threadpool_limits else None
    try:
        step = TrainStep(run)
        g = config.global_batch
        counts = split_counts(g, comm.size)
        start = sum(counts[:comm.rank])
        rng = numpy.random.default_rng(0)
        ids = numpy.sort(rng.choice(len(run.train_set), size=g, replace=len(run.train_set) < g))
        ids = ids[start:start + counts[comm.rank]]
        arrays = [run.train_set.read(name, ids) for name in run.objective.features]
        x, y = arrays[0], arrays[1] if len(arrays) > 1 else None
        times = []
        for i in range(WARMUP_STEPS + steps):
            t0 = time.perf_counter()
            step(x, y, g, i)
            if i >= WARMUP_STEPS:
                times.append(time.perf_counter() - t0)
    finally:
        run.close()
        if limit is not None:
            limit.restore_original_limits()
    medians = comm.allgather_obj(statistics.median(times))
    nodes = sum(comm.allgather_obj(comm.local_rank == 0))  # one first rank per node
    return Probe(ranks=comm.size, nodes=nodes, per_rank_batch=max(counts),
                 step_s=max(medians), steps=steps)
