"""``mpidl plan gpt --layouts``: tensor x pipeline x data layouts, priced and proposed.

The command half of :mod:`mpidl.layouts` (the formulas): it reads the gpt model's shape
from the configuration (no model is built, nothing is measured, so a 175-billion-
parameter model plans in a second), prices every layout of each ``--ranks`` count on
``--device`` over ``--node-network`` and ``--network``, prints the best and proposes
the fastest that fits a rank's memory::

    mpidl plan gpt --layouts --model.layers=96 --model.dim=12288 --model.heads=96 \\
        --data.seq-len=2048 --data.vocab-size=51200 --global-batch=1536 --zero=1 \\
        --precision bf16 --recompute selective --device h100 --ranks 1024 \\
        --ranks-per-node 8 --node-network nvlink --network ib-ndr

Bad flags exit 2 with one message (docs/exit-status.md), as the rest of ``mpidl plan``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence

from hpc.argtypes import positive_int
from mpidl import layouts, plan
from mpidl.parallel.pipeline_schedule import flags_problem as schedule_flags_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The layout flags of ``mpidl plan``."""
    lay = parser.add_argument_group(
        "layouts", "tensor x pipeline x data layouts of the gpt model, priced from its "
        "shape on --device (mpidl.layouts); no model is built and nothing is measured")
    lay.add_argument("--layouts", action="store_true", help="price every layout of each rank "
                     "count (tensor within a node) and propose the fastest that fits")
    lay.add_argument("--pipeline-parallel", type=positive_int, metavar="P",
                     help="only layouts of P stages (default: every P)")
    lay.add_argument("--microbatch-size", type=positive_int, default=1, metavar="B",
                     help="sequences per microbatch (1)")
    lay.add_argument("--pipeline-schedule", choices=layouts.SCHEDULES,
                     help="(default: the config's pipeline_schedule, 1f1b)")
    lay.add_argument("--virtual-stages", type=positive_int, metavar="V",
                     help="model chunks per rank, interleaved only (default: the config's "
                          "virtual_stages if > 1, else 2)")
    lay.add_argument("--recompute", choices=layouts.RECOMPUTE,
                     help="activation recomputation (default: the config's recompute, none)")
    lay.add_argument("--precision", choices=layouts.PRECISIONS, default="fp32",
                     help="fp32, or half precision with fp32 master weights (fp32)")


LAYOUT_FLAGS = (("pipeline_parallel", None), ("microbatch_size", 1),
                ("pipeline_schedule", None), ("virtual_stages", None),
                ("recompute", None), ("precision", "fp32"))


def flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the layout flags together (None: nothing)."""
    given = [f"--{k.replace('_', '-')}" for k, plain in LAYOUT_FLAGS
             if getattr(args, k) != plain]
    if given and not args.layouts:
        return f"{given[0]} prices tensor x pipeline x data layouts: add --layouts"
    if not args.layouts:
        return None
    if args.device is None:
        return ("--layouts prices the gpt model's layouts from FLOPs: name the device with "
                "--device (e.g. --device h100)")
    if args.virtual_stages is not None and args.pipeline_schedule not in ("interleaved", None):
        return (f"--virtual-stages={args.virtual_stages}: model chunks per rank are the "
                "interleaved schedule's; add --pipeline-schedule interleaved")
    # The rule mpidl train refuses with too (--virtual-stages=1 with interleaved).
    return schedule_flags_problem(args.pipeline_schedule, args.virtual_stages)


def from_config(args: argparse.Namespace, config: Any) -> None:
    """The layout flags left at their defaults take the config's pipeline keys (a run's
    config.toml, a TOML file): ``pipeline_parallel``, ``pipeline_schedule``,
    ``virtual_stages``, ``recompute``. The flags of the same names are the planner's own
    (argparse reads them before the config's overrides), so a flag given wins. Then
    the flags are checked together again (ValueError)."""
    if args.pipeline_parallel is None and config.pipeline_parallel > 1:
        args.pipeline_parallel = config.pipeline_parallel
    if args.pipeline_schedule is None:
        args.pipeline_schedule = config.pipeline_schedule
    if args.virtual_stages is None and config.virtual_stages > 1:
        args.virtual_stages = config.virtual_stages
    if args.recompute is None:
        args.recompute = config.recompute
    problem = flags_problem(args)
    if problem:
        raise ValueError(f"{problem} (with the config's pipeline_parallel="
                         f"{config.pipeline_parallel}, pipeline_schedule="
                         f"{config.pipeline_schedule}, virtual_stages={config.virtual_stages})")


def gpt_shape(config: Any) -> layouts.GPTShape:
    """The gpt model's sizes from ``config`` (its [model] keys over the model's defaults;
    the sequence and vocabulary from --data's manifest, else the generated corpus's)."""
    import inspect

    from mpidl.models.gpt import GPT

    if config.model.name != "gpt":
        raise ValueError(f"--layouts prices the gpt model's layouts; this config's model is "
                         f"{config.model.name!r}: use `mpidl plan gpt --layouts ...`")
    defaults = {k: v.default for k, v in inspect.signature(GPT).parameters.items()}
    kw = {**defaults, **config.model.kwargs}
    seq, vocab = config.data.seq_len, config.data.vocab_size
    if config.data.path:
        from mpidl.data import ShardedDataset

        train = ShardedDataset(os.path.join(config.data.path, "train"))
        seq = max(int(train.features["x"].shape[-1]) - 1, 1)
        vocab = len(train.vocab) if train.vocab else vocab
    return layouts.GPTShape(layers=int(kw["layers"]), hidden=int(kw["dim"]),
                            heads=int(kw["heads"]), seq=int(seq), vocab=int(vocab),
                            global_batch=config.global_batch, ffn=int(kw["ffn"] or 0),
                            tied=bool(kw["tie_weights"]))


def _rates(device: Any, precision: str, tf32: bool = False) -> tuple[float, float | None]:
    """Sustained and peak FLOP/s of ``device`` for the GEMMs the engine runs in
    ``precision`` (#48): fp32 in full FP32 (``fp32_tflops``) unless the job chose TF32
    (``tf32``: the profile's ``tflops``, TF32-based), 16-bit floats on the tensor cores
    (``bf16_tflops``; mpidl.backend.matmul gives cuBLAS 16-bit operands). A CPU profile
    has one rate."""
    if precision == "fp32":
        if device.kind != "gpu" or tf32:
            peak = device.extra.get("tf32_peak_tflops")
            return device.flops, peak * 1e12 if peak else None
        rate, peak = device.extra.get("fp32_tflops"), device.extra.get("fp32_peak_tflops")
        if not rate:
            raise ValueError(f"device profile {device.name!r} ({device.path}) has no "
                             f"fp32_tflops (sustained full-FP32 TFLOP/s, what float32 GEMMs "
                             f"run at without TF32): add it with its source, or plan with "
                             f"--tf32")
        return rate * 1e12, peak * 1e12 if peak else None
    rate, peak = device.extra.get("bf16_tflops"), device.extra.get("bf16_peak_tflops")
    if not rate:
        raise ValueError(f"device profile {device.name!r} ({device.path}) has no bf16_tflops "
                         f"(sustained half-precision TFLOP/s): add it with its source, or "
                         f"plan --precision fp32")
    return rate * 1e12, peak * 1e12 if peak else None


def _gemm_kind(device: Any, precision: str, tf32: bool) -> str:
    """What the GEMMs priced by :func:`_rates` run in, for the table's header."""
    if precision != "fp32":
        return f"{precision} on the tensor cores"
    if device.kind != "gpu":
        return "fp32"
    return "TF32 (--tf32)" if tf32 else "full FP32 (no --tf32)"


def plan_layouts(args: argparse.Namespace, rest: Sequence[str]) -> int:
    """``mpidl plan gpt --layouts``: the layouts table and a proposal per rank count."""
    from hpc import costmodel

    from mpidl.train.config import ConfigError, load_config, split_args

    try:
        preset, overrides = split_args(list(rest))
        config = load_config(preset, overrides)
        from_config(args, config)
        shape = gpt_shape(config)
        if config.zero not in (0, 1):
            raise ValueError(f"--zero={config.zero}: layouts with a pipeline price ZeRO 1 "
                             "(the distributed optimizer) at most, as Megatron and DeepSpeed "
                             "run them; use --zero=1 or --zero=0")
        device = costmodel.load_device(args.device)
        rate, peak = _rates(device, args.precision, config.tf32)
        network = costmodel.load_network(args.network)
        node_link = (plan.shared_memory_link() if args.node_network == "shm"
                     else costmodel.load_network(args.node_network))
    except (ConfigError, costmodel.ProfileError, ValueError, OSError) as e:
        print(f"mpidl plan: error: {e}", file=sys.stderr)
        return 2
    interleaved = args.pipeline_schedule == "interleaved"
    opts = layouts.Options(precision=args.precision, recompute=args.recompute,
                           schedule=args.pipeline_schedule,
                           virtual=(args.virtual_stages or 2) if interleaved else 1,
                           microbatch=args.microbatch_size, zero=config.zero)
    memory = args.memory_gb * 1e9 if args.memory_gb is not None else device.memory_bytes
    tensors = [config.tensor_parallel] if config.tensor_parallel > 1 else None
    pipelines = [args.pipeline_parallel] if args.pipeline_parallel else None
    print(f"mpidl plan: gpt, {shape.params():,} parameters ({shape.layers} layers, width "
          f"{shape.hidden}, {shape.heads} heads, sequence {shape.seq}, vocabulary "
          f"{shape.vocab}), global batch {shape.global_batch}, {args.precision} (GEMMs "
          f"{_gemm_kind(device, args.precision, config.tf32)} at {rate / 1e12:g} TFLOP/s), "
          f"recompute "
          f"{args.recompute}, {args.pipeline_schedule}"
          + (f" x {opts.virtual} chunks" if interleaved else "")
          + f", ZeRO {config.zero}\ndevice: {device.name} ({rate / 1e12:g} TFLOP/s sustained"
          + (f" of {peak / 1e12:g} peak" if peak else "") + f", {memory / 1e9:g} GB); "
          f"network: {network.name} between nodes, {node_link.name} within "
          f"({args.ranks_per_node} rank(s) per node)\n")
    found, proposals = {}, {}
    for r in sorted(set(args.ranks)):
        rows = layouts.search(shape, opts, r, args.ranks_per_node, tensors, pipelines,
                              rate=rate, peak=peak, memory=memory, node_time=node_link.time,
                              network_time=network.time)
        found[r] = rows
        if rows:
            print(layouts.format_layouts(rows, limit=8) + "\n")
        if rows and rows[0].fits:
            proposals[r] = rows[0]
    lines = [_proposal_line(r, found[r], proposals.get(r), memory) for r in sorted(found)]
    for line in lines:
        print(f"proposal: {line}")
    if args.json:
        doc = {"model": "gpt", "shape": dataclasses.asdict(shape), "params": shape.params(),
               "model_flops": shape.model_flops(),
               "hardware_flops": shape.hardware_flops(args.recompute),
               "options": dataclasses.asdict(opts), "device": device.name,
               "network": network.name, "node_network": node_link.name,
               "memory_per_rank": memory,
               "layouts": [row.as_dict() for r in sorted(found) for row in found[r]],
               "proposals": {str(r): c.as_dict() for r, c in proposals.items()},
               "verdict": lines}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
    return 0


def _proposal_line(ranks: int, rows: list, best: Any, memory: float) -> str:
    if not rows:
        return (f"{ranks} ranks: no layout divides them for this shape and batch (tensor "
                "within a node dividing the heads, stages no more than the layers, a whole "
                "number of microbatches per data rank)")
    if best is None:
        least = min(rows, key=lambda c: c.memory_bytes)
        return (f"{ranks} ranks: no layout fits {memory / 1e9:g} GB per rank; the smallest, "
                f"{least.layout}, needs {least.memory_bytes / 1e9:.1f} GB: recompute "
                "(--recompute selective or full), --zero=1, or more ranks")
    mfu = f", MFU {best.mfu:.1%}" if best.mfu is not None else ""
    return (f"{ranks} ranks: {best.layout} ({best.microbatches} microbatches, bubble "
            f"{best.bubble:.1%}), {best.memory_bytes / 1e9:.1f} GB per rank of "
            f"{memory / 1e9:g}, step {best.step_s:.2f} s, {best.tflops_per_rank:.0f} "
            f"TFLOP/s per rank{mfu}")
