"""One training step of a reference model on the fake device, counted per phase.

``python -m mpidl.testing.fakedevice --model NAME [--zero 3 | --tensor-parallel 2 |
--pipeline-parallel 2 --microbatches 4] [--precision fp16|bf16] [--optimizer lamb]
[--recompute full]`` builds the run of preset ``NAME`` (``mpidl train NAME``'s, on a
small generated corpus) with ``backend = "cupy"`` inside :func:`~mpidl.testing.
fakedevice.fake_cupy`, on thread ranks (:func:`~mpidl.testing.run_ranks`), runs one
step to warm up (optimizer state, buffers), then counts the next step and a checkpoint
of it, and prints one JSON line: per phase, the most any rank counted of ``launches``,
``host_reads``, ``syncs``, ``widened_gemms``, and ``gemm_dtypes``; beside them
``optimizer_tensors`` (the tensors a rank's optimizer steps: ZeRO's flat shards) and
``model_tensors`` (the model's parameter tensors on the rank: the unit of the launch
budget, docs/testing.md), ``uploads``, and ``read_sites`` and ``widened_sites`` (where
the host reads and the widened GEMMs are, on the rank with the most reads).

Bad input (an unknown model, an impossible layout, bf16 where the modelled CuPy has
none) exits 2 before any step, with the message on stderr. :func:`count_step` is what
tests call.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from typing import Any, Sequence

from mpidl.testing.fakedevice import PHASES, fake_cupy

# The corpus of every model: small, so that a step runs in seconds on one core.
_DATA = ("--data.num-train=64", "--data.num-test=16")
_BATCH = 16  # global: 2 data ranks x 2 pipeline microbatches of 4 still divide it


def _overrides(zero: int, tensor: int, pipeline: int, microbatches: int, precision: str,
               optimizer: str | None, recompute: str, cache_dir: str) -> list[str]:
    out = [*_DATA, f"--data.cache-dir={cache_dir}", "--backend=cupy",
           f"--global-batch={_BATCH}", f"--zero={zero}", f"--tensor-parallel={tensor}",
           f"--pipeline-parallel={pipeline}", f"--microbatches={microbatches}",
           f"--precision={precision}", f"--recompute={recompute}", "--steps=2"]
    if optimizer:
        out.append(f"--optimizer={optimizer}")
    return out


def _rank_step(comm: Any, fake: Any, config: Any, data_dir: str, run_dir: str) -> dict:
    """Two steps on this rank (the second counted) and a checkpoint: this rank's counts."""
    from mpidl.train.build import build_run
    from mpidl.train.checkpointing import RunCheckpoints
    from mpidl.train.log import Logger
    from mpidl.train.step import TrainStep

    log = Logger(comm.rank, comm.size)
    run = build_run(config, comm, data_dir, log)
    try:
        step = TrainStep(run, log)
        batches = iter(run.loader)
        for i in range(2):
            batch = next(batches)
            x, y, n = batch[0], batch[1] if len(batch) > 2 else None, batch[-1]
            if i == 1:
                fake.reset_counts()
            step(x, y, n, i)
        RunCheckpoints(run, run_dir, log).save(2, lambda: {})
        counts = {p: c.as_dict() for p, c in fake.counts().items()}
        return {"counts": counts, "optimizer_tensors": len(list(run.dp.parameters())),
                "model_tensors": len(list(run.model.parameters()))}
    finally:
        run.close()


def count_step(model: str, ranks: int = 2, zero: int = 0, tensor: int = 1,
               pipeline: int = 1, microbatches: int = 1, precision: str = "fp32",
               optimizer: str | None = None, recompute: str = "none",
               cupy_version: str = "13.6.0") -> dict:
    """The counts of one step of preset ``model`` on ``ranks`` thread ranks of the fake
    device (see the module docstring): the dict the command prints.

    Raises ConfigError (or ValueError) for bad input, before any step.
    """
    from mpidl.backend import precision_problem
    from mpidl.testing import run_ranks
    from mpidl.train.config import ConfigError, load_config
    from mpidl.train.log import Logger
    from mpidl.train.task import prepare_data

    with tempfile.TemporaryDirectory(prefix="mpidl-fake-step-") as tmp:
        config = load_config(model, _overrides(zero, tensor, pipeline, microbatches,
                                               precision, optimizer, recompute, tmp))
        with fake_cupy(cupy_version) as fake:
            problem = precision_problem(config.backend, config.precision)
            if problem:  # as mpidl train: refused before any work
                raise ConfigError(problem)
            def rank(comm: Any) -> dict:
                data_dir = prepare_data(config, comm, Logger(comm.rank, comm.size))
                return _rank_step(comm, fake, config, data_dir, f"{tmp}/run")

            results = run_ranks(ranks, rank, timeout=120)
    out: dict[str, Any] = {"model": model, "ranks": ranks, "zero": zero,
                           "tensor_parallel": tensor, "pipeline_parallel": pipeline,
                           "microbatches": microbatches, "precision": precision,
                           "optimizer": config.optimizer, "recompute": recompute}
    for key in ("launches", "host_reads", "syncs", "widened_gemms", "uploads"):
        out[key] = {p: max(r["counts"][p][key] for r in results) for p in PHASES}
    out["gemm_dtypes"] = {p: _most(r["counts"][p]["gemm_dtypes"] for r in results)
                          for p in PHASES}
    for key in ("optimizer_tensors", "model_tensors"):
        out[key] = max(r[key] for r in results)
    busiest = max(results, key=lambda r: sum(r["counts"][p]["host_reads"] for p in PHASES))
    for key in ("read_sites", "widened_sites"):
        out[key] = {p: dict(collections.Counter(busiest["counts"][p][key]))
                    for p in PHASES if busiest["counts"][p][key]}
    return out


def _most(tables: Any) -> dict:
    out: dict[str, int] = {}
    for table in tables:
        for key, n in table.items():
            out[key] = max(out.get(key, 0), n)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from mpidl.train.config import ConfigError, list_presets

    parser = argparse.ArgumentParser(
        prog="python -m mpidl.testing.fakedevice",
        description="One training step on the fake device; prints its counts as JSON.")
    parser.add_argument("--model", required=True,
                        help=f"a preset: {', '.join(list_presets())}")
    parser.add_argument("--ranks", type=int, default=2, help="thread ranks (default 2)")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--pipeline-parallel", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--optimizer", default=None)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--cupy-version", default="13.6.0",
                        help="the CuPy modelled (14 and later have bfloat16)")
    args = parser.parse_args(argv)
    if args.model not in list_presets():
        print(f"python -m mpidl.testing.fakedevice: --model {args.model!r} is not a "
              f"preset; use one of {', '.join(list_presets())}", file=sys.stderr)
        return 2
    if args.ranks < 1:
        print(f"python -m mpidl.testing.fakedevice: --ranks {args.ranks}: at least 1",
              file=sys.stderr)
        return 2
    try:
        result = count_step(args.model, args.ranks, args.zero, args.tensor_parallel,
                            args.pipeline_parallel, args.microbatches, args.precision,
                            args.optimizer, args.recompute, args.cupy_version)
    except (ConfigError, ValueError) as e:
        print(f"python -m mpidl.testing.fakedevice: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


__all__ = ["count_step", "main"]
