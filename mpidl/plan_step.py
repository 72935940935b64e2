"""What a distributed step costs beyond its compute, as :mod:`mpidl.plan` prices it.

Three things the alpha-beta price of the gradient's allreduce (:mod:`hpc.costmodel`)
does not say, each measured rather than assumed where a measurement is at hand:

- **Overlap achieved.** DataParallel starts a bucket's allreduce from backward's hooks,
  so the exchange can hide behind the rest of backward (2/3 of a step's compute). How
  much it hides depends on the MPI library's progress, not on the model: Open MPI over
  TCP moves a non-blocking message only inside MPI calls and the kernel's socket
  buffers. The planner prices ``exposed = max(comm - share * backward, 0)``;
  ``share`` is :data:`OVERLAP_SHARE` by default, or what a run achieved
  (:func:`achieved_overlap_share`, from its measured wait for the exchange).
- **The fixed cost of a distributed step** (#30): the ranks' skew (each step waits for
  the slowest), the small allreduces of the step's agreement (finite check, loss), a
  sparse gradient's exchange and per-step Python. A short probe at several ranks
  (``mpiexec -n 2 mpidl plan``, :mod:`mpidl.plan_probe`) measures the step; what it
  took beyond the single-process compute and the priced exchange is
  :func:`fixed_cost`, added to every distributed row. It matters for short steps: bow's
  ~1.5 ms step ran 0.8-1.0x at 2 ranks where the exchange alone predicted 1.2x.
- **Shared cores.** Ranks that share fewer cores than there are ranks (an
  oversubscribed node, or the virtual cluster's nodes on one machine) take turns, in
  compute and in the exchange's protocol work alike: both grow by ``ranks / cores``
  (:func:`shared_cores`). Measured on the virtual cluster (3 nodes on 2 cores): a 4 MB
  allreduce over 3 nodes took 2.4x the 2-node time where a ring's volume says 1.33x.
"""
from __future__ import annotations

import dataclasses

BACKWARD_SHARE = 2.0 / 3.0  # of a step's compute: what overlapped buckets can hide behind

# The share of backward the exchange hides behind when no run measured it: none.
# Measured on the virtual cluster (tests/cluster: Open MPI 5.0 over TCP, 1 Gbit/s
# links, benchmarks/plan_check.py --rate 1gbit): mlp at 2 nodes waited 100 ms for an
# exchange priced at 130 ms, but its compute grew from 21 ms (one process) to 64 ms:
# without a progress thread Open MPI moves a non-blocking message only inside MPI
# calls, so the exchange's work lands in backward instead of hiding behind it, and the
# step (163 ms) was longer than compute plus the whole exchange (151 ms). A run that
# hides more says so: ``mpidl plan --from-run`` takes its achieved share.
OVERLAP_SHARE = 0.0


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """The planner's inputs beyond compute and the network profile.

    Attributes:
        overlap_share: share of backward's time that the exchange hides behind, with
            overlap on (0: none hidden, 1: all of backward).
        overlap_from: where ``overlap_share`` comes from (shown under the table).
        fixed_s: seconds every distributed step costs beyond compute and the exchange.
        fixed_from: where ``fixed_s`` comes from.
        cores: cores all the ranks share; None: a core (or device) per rank.
    """

    overlap_share: float = OVERLAP_SHARE
    overlap_from: str = f"default {OVERLAP_SHARE:g} (measured on TCP, docs/planning.md)"
    fixed_s: float = 0.0
    fixed_from: str = "not measured (probe it: mpiexec -n 2 mpidl plan ...)"
    cores: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap_share <= 1.0:
            raise ValueError(f"overlap_share={self.overlap_share}: a share of backward, "
                             "from 0 to 1")
        if self.fixed_s < 0:
            raise ValueError(f"fixed_s={self.fixed_s}: seconds, >= 0")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores={self.cores}: at least 1")


def exposed_comm(comm_s: float, compute_s: float, overlap: bool, share: float) -> float:
    """Seconds of the exchange the step waits for: all of it without overlap, else what
    outlasts ``share`` of backward (``BACKWARD_SHARE`` of the compute)."""
    if not overlap:
        return comm_s
    return max(comm_s - share * BACKWARD_SHARE * compute_s, 0.0)


def achieved_overlap_share(comm_s: float, waited_s: float, compute_s: float) -> float:
    """The overlap share a run achieved: the priced exchange ``comm_s`` less the wait
    the run measured (``time_comm``), over its backward's time, clipped to [0, 1].

    A wait longer than the priced exchange (a slower network than the profile says, or
    the ranks' skew) is no overlap, not a negative one.
    """
    backward = BACKWARD_SHARE * compute_s
    if backward <= 0 or comm_s <= 0:
        return 0.0
    return min(max((comm_s - waited_s) / backward, 0.0), 1.0)


def shared_cores(seconds: float, ranks: int, cores: int | None) -> float:
    """A rank's ``seconds`` of work when ``ranks`` ranks share ``cores`` cores (None:
    one each)."""
    if cores is None or ranks <= cores:
        return seconds
    return seconds * ranks / cores


def fixed_cost(probed_step_s: float, compute_s: float, exposed_s: float) -> float:
    """The fixed cost of a distributed step from a probe: its measured step less the
    single-process compute at the probe's batch and the exchange priced for it
    (never below 0: a probe faster than the price adds nothing)."""
    return max(probed_step_s - compute_s - exposed_s, 0.0)
