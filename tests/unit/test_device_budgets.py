"""The device budgets of a training step (#48), counted on the fake device.

Each reference model and mode runs one step as if on a GPU
(:func:`mpidl.testing.fake_step.count_step`: thread ranks, ``backend = "cupy"`` on
:mod:`mpidl.testing.fakedevice`), and its counts must stay within the budgets that
docs/testing.md ("Device budgets") states:

- host reads in forward, backward, exchange and optimizer: at most :data:`STEP_READS`
  (the loss and the non-finite check), besides the sites of :data:`KNOWN_READS` (open
  points of #48, at most once a step each);
- no float32 GEMM whose operand was just widened from 16 bits, besides attention's
  (:data:`KNOWN_WIDENED`), and 16-bit GEMMs where the precision is 16-bit;
- optimizer-phase launches per parameter tensor of the model: :data:`OPTIMIZER_LAUNCHES`;
- no stream synchronisation in forward, backward and the optimizer.

``hpc/gpu_check.py`` counts the same on a real device (its ``--budget-step``).
"""
from __future__ import annotations

import pytest

from mpidl.testing.fake_step import count_step

STEP_PHASES = ("forward", "backward", "exchange", "optimizer")
STEP_READS = 2
# Host reads still in a step, each an open point of #48 (docs/testing.md says why).
KNOWN_READS = ("train/objective.py", "parallel/sparse.py")
KNOWN_WIDENED = ("functions/attention.py",)
# Optimizer-phase launches per model parameter tensor: the update, the non-finite check
# (2), clipping (4), the noise scale's norm (3) and fp16's unscaling (2) that the
# phase holds.
OPTIMIZER_LAUNCHES = {"adamw": 28, "sgd": 16, "lars": 28, "lamb": 42}

MODES = [
    ("reviews", {}),
    ("reviews-transformer", {}),
    ("cosmo", {}),
    ("gpt", {}),
    ("gpt", dict(zero=3)),
    ("gpt", dict(tensor=2)),
    ("gpt", dict(pipeline=2, microbatches=4)),
    ("gpt", dict(precision="fp16")),
    ("gpt", dict(precision="bf16", cupy_version="14.0.0")),
    ("gpt", dict(optimizer="lamb")),
    ("gpt", dict(optimizer="lars", zero=1)),
    ("gpt", dict(recompute="full")),
]


def _known(site: str, known: tuple[str, ...]) -> bool:
    return any(site.startswith(k) or f"/{k}" in site for k in known)


def check_budgets(result: dict) -> list[str]:
    """What ``result`` (:func:`count_step`'s) spends beyond the budgets: [] when none."""
    over = []
    sites = {}
    for phase in STEP_PHASES:
        for site, n in result["read_sites"].get(phase, {}).items():
            sites[site] = sites.get(site, 0) + n
    unexplained = {s: n for s, n in sites.items() if not _known(s, KNOWN_READS)}
    if sum(unexplained.values()) > STEP_READS:
        over.append(f"{sum(unexplained.values())} host reads a step, budget {STEP_READS}: "
                    f"{unexplained}")
    over += [f"known read {s} {n} times a step, budget 1" for s, n in sites.items()
             if _known(s, KNOWN_READS) and n > 1]
    for phase, where in result["widened_sites"].items():
        bad = {s: n for s, n in where.items() if not _known(s, KNOWN_WIDENED)}
        if bad:
            over.append(f"{phase}: float32 GEMMs of widened 16-bit operands at {bad}")
    if result["precision"] != "fp32":
        half = {"fp16": "float16", "bf16": "bfloat16"}[result["precision"]]
        if not result["gemm_dtypes"]["forward"].get(f"{half},{half}"):
            over.append(f"no {half} GEMM in forward: {result['gemm_dtypes']['forward']}")
    per_tensor = result["launches"]["optimizer"] / result["model_tensors"]
    limit = OPTIMIZER_LAUNCHES[result["optimizer"]]
    if per_tensor > limit:
        over.append(f"{per_tensor:.1f} optimizer launches per parameter tensor "
                    f"({result['optimizer']}), budget {limit}")
    syncs = {p: result["syncs"][p] for p in ("forward", "backward", "optimizer")
             if result["syncs"][p]}
    if syncs:
        over.append(f"stream synchronisations in {syncs}")
    return over


def _id(model: str, mode: dict) -> str:
    return "-".join([model] + [f"{k}{v}" for k, v in mode.items()])


@pytest.mark.parametrize("model,mode", MODES, ids=[_id(m, kw) for m, kw in MODES])
def test_a_step_of_each_model_and_mode_keeps_its_device_budgets(model, mode):
    result = count_step(model, **mode)
    assert check_budgets(result) == [], result


def test_the_budget_check_fails_a_step_over_budget():
    # The check itself: a made-up step with a host read per microbatch (the pipeline
    # before #48), a widened GEMM in a Linear and too many optimizer launches.
    result = {"read_sites": {"forward": {"parallel/pipeline.py:242 in step": 4,
                                         "mpidl/backend.py:89 in as_numpy": 1}},
              "widened_sites": {"forward": {"mpidl/backend.py:181 in matmul": 2}},
              "precision": "fp16", "gemm_dtypes": {"forward": {"float32,float32": 2}},
              "launches": {"optimizer": 1000}, "model_tensors": 10, "optimizer": "adamw",
              "syncs": {"forward": 0, "backward": 1, "optimizer": 0}}
    over = check_budgets(result)
    assert len(over) == 5, over
    assert over[0].startswith("5 host reads a step, budget 2")
