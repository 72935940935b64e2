"""What a run's gradient noise scale says about more ranks (``mpidl plan --from-run``).

Data parallelism at a fixed batch per rank ``b`` grows the global batch with the ranks,
``B = R b``. McCandlish et al. (2018, eq. 2.11) give the optimizer steps to reach a loss
as ``S = S_min (1 + B_noise / B)``: far below the noise scale ``B_noise`` doubling the
batch halves the steps, far above it the steps stop falling, and the extra ranks only
spend more samples (``E = E_min (1 + B / B_noise)``). The critical batch is about
``B_noise``: past ``R* = B_noise / b`` ranks, each doubling cuts the steps by a quarter
or less. ``mpidl train`` measures the noise scale in data-parallel runs
(:mod:`mpidl.train.noise`, the ``noise_scale`` of its train records).
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence


def run_noise_scale(records: Iterable[dict]) -> float | None:
    """The median ``noise_scale`` of a run's second half of train records (the estimate
    settles as the moving averages fill), or None when the run measured none."""
    values = [r["noise_scale"] for r in records
              if r.get("kind") == "train" and r.get("noise_scale") is not None]
    tail = values[len(values) // 2:]
    return statistics.median(tail) if tail else None


def steps_ratio(noise: float, batch: float, base: float) -> float:
    """Optimizer steps to the same loss at global batch ``batch`` over those at ``base``
    (eq. 2.11; the samples per step grow, the steps fall less and less)."""
    return (1 + noise / batch) / (1 + noise / base)


def critical_ranks(noise: float, per_rank: int) -> int:
    """The rank count at which the global batch reaches the noise scale."""
    return max(1, math.ceil(noise / per_rank))


def noise_rows(noise: float, per_rank: int, ranks: Sequence[int]) -> list[dict]:
    """Per rank count, growing the batch with the ranks: the global batch, the steps
    relative to one rank, and how much of the ranks' increase the steps' cut returns."""
    rows = []
    for r in sorted(set(ranks) | {1}):
        ratio = steps_ratio(noise, r * per_rank, per_rank)
        rows.append({"ranks": r, "global_batch": r * per_rank, "steps_vs_1_rank": ratio,
                     "step_cut_efficiency": (1 / ratio) / r})
    return rows


def format_noise(noise: float, per_rank: int, ranks: Sequence[int]) -> str:
    """The plan's section on the noise scale: the table and the rank count where more
    ranks stop cutting the number of steps."""
    star = critical_ranks(noise, per_rank)
    lines = [f"gradient noise scale measured by the run: B_noise ~ {noise:,.0f} samples "
             f"(McCandlish et al. 2018). With the batch growing with the ranks ({per_rank} "
             "per rank), steps to the same loss go as 1 + B_noise / B:",
             "ranks  global batch  steps vs 1 rank  steps cut / ranks added",
             "-----  ------------  ---------------  -----------------------"]
    for row in noise_rows(noise, per_rank, ranks):
        lines.append(f"{row['ranks']:5d}  {row['global_batch']:12,d}  "
                     f"{row['steps_vs_1_rank']:15.3f}  {row['step_cut_efficiency']:23.2f}")
    lines.append(f"past {star} rank(s) (global batch {star * per_rank:,} ~ B_noise) more "
                 "ranks stop cutting the number of steps: each doubling then saves a "
                 "quarter of them or less, and costs twice the samples")
    return "\n".join(lines)


__all__ = ["run_noise_scale", "steps_ratio", "critical_ranks", "noise_rows", "format_noise"]
