"""``mpidl plan``: the command line of the planner (:mod:`mpidl.plan` is the model).

Every input is checked before anything is measured (docs/exit-status.md): the numbers
by their argparse types (:mod:`hpc.argtypes`), the output files' directories, the
configuration, the rank counts against its global batch, the profiles. A bad one exits
2 with one message naming it; no traceback, no prediction from nonsense.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
from typing import Any, Sequence

from hpc.argtypes import nonnegative_float, output_file, positive_float, positive_int
from mpidl import plan, plan_layouts
from mpidl.plan import Prediction, Workload
from mpidl.plan_noise import critical_ranks, format_noise, noise_rows
from mpidl.plan_probe import Probe
from mpidl.plan_step import (StepCosts, achieved_overlap_share, exposed_comm, fixed_cost)


def rank_counts(text: str) -> list[int]:
    """``--ranks 1,2,4``: rank counts >= 1, comma-separated."""
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: rank counts >= 1, "
                                         "comma-separated (1,2,4)")
    return ranks


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpidl plan", description=plan.__doc__.split("\n\n")[0],
                                usage="mpidl plan [PRESET|CONFIG.toml] [OPTIONS] "
                                      "[--key=value ...]",
                                epilog="PRESET or CONFIG.toml and --key=value come first or "
                                       "anywhere, as `mpidl train` takes them.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=positive_int, help="training samples per epoch "
                   "(default: the dataset's, or the generated corpus's num_train)")
    p.add_argument("--epochs", type=positive_float, help="epochs (default: the config's)")
    p.add_argument("--ranks", type=rank_counts, default=[1, 2, 4, 8],
                   help="rank counts, comma-separated (1,2,4,8)")
    p.add_argument("--ranks-per-node", type=positive_int, default=1,
                   help="ranks sharing a node (GPUs or cores per node)")
    p.add_argument("--network", default="10gbe", help="network profile between nodes")
    p.add_argument("--node-network", default="shm",
                   help="network profile within a node (shm: shared memory, measured here)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--device", help="device profile: compute from FLOPs, not measured here")
    src.add_argument("--step-time", type=positive_float, help="seconds of a 1-rank step at "
                     "the global batch, measured elsewhere")
    src.add_argument("--from-run", metavar="RUN_DIR", help="a run directory: its measured "
                     "compute and input times and its config")
    p.add_argument("--cores", type=positive_int, help="cores all the ranks share (an "
                   "oversubscribed node, a virtual cluster on one machine): compute and "
                   "the exchange grow by ranks / cores beyond them (default: a core per "
                   "rank)")
    p.add_argument("--memory-gb", type=positive_float, help="memory per rank for the largest "
                   "model that fits (default: the device profile's, else this machine's "
                   "memory over --ranks-per-node)")
    p.add_argument("--compression", metavar="HOW",
                   help="price the gradients compressed too: fp16, bf16 or powersgd:R "
                        "(default: the config's compression key); prints both tables and "
                        "whether compression changes the verdict")
    p.add_argument("--setup-hours", type=nonnegative_float, default=0.0,
                   help="one-off hours to set the distributed runs up")
    p.add_argument("--queue-hours", type=nonnegative_float, default=0.0,
                   help="hours each distributed run waits in the queue")
    plan_layouts.add_arguments(p)
    p.add_argument("--json", metavar="FILE", type=output_file, help="write the table as JSON")
    p.add_argument("--plot", metavar="FILE", type=output_file,
                   help="draw speedup and time to train (PNG)")
    p.add_argument("--sbatch", metavar="FILE", type=output_file, help="write a batch script "
                   "for the best rank count (`mpidl sbatch` templates)")
    p.add_argument("--force", action="store_true", help="write over existing --json, --plot "
                   "and --sbatch files (never over the run, config or dataset read)")
    return p


def check_outputs(args: argparse.Namespace, reads: Sequence[str]) -> None:
    """OutputError (:func:`hpc.files.check_output`) if a --json, --plot or --sbatch file
    exists without --force, or is one of ``reads``: before anything is measured."""
    from hpc.files import check_output

    for path in (args.json, args.plot, args.sbatch):
        if path is not None:
            check_output(path, force=args.force, reads=reads)


def main(argv: Sequence[str]) -> int:
    """``mpidl plan [PRESET|CONFIG] [OPTIONS] [--key=value ...]``.

    Planning is one process's work; under a launcher every rank first takes part in the
    probe of a distributed step (:mod:`mpidl.plan_probe`, when compute is measured
    here), then rank 0 plans and prints while the others wait, and every rank exits
    with its status (argparse's 2 included).
    """
    from hpc.env import detect

    if detect().size <= 1:
        return _plan(argv)
    from mpidl.comm import world
    from mpidl.comm.ledger import patience

    comm = world()
    probe = _probe(argv, comm)
    code = None
    if comm.rank == 0:
        try:
            code = _plan(argv, probe)
        except SystemExit as e:  # argparse: --help (0) or a bad argument (2)
            code = e.code if isinstance(e.code, int) else 2
    with patience("rank 0 plans"):
        return comm.bcast_obj(code)


def _probe(argv: Sequence[str], comm: Any) -> Probe | None:
    """The probe's result on every rank, or None on every rank where there is nothing to
    probe (compute not measured here, --layouts) or the command line is bad (rank 0's
    plan then reports it). Collective; the command line and the configuration are the
    same on every rank, so every rank decides alike before the first collective."""
    import contextlib
    import io

    from mpidl.data import DataError
    from mpidl.plan_probe import probe_step
    from mpidl.train.config import ConfigError, load_config, split_args
    from mpidl.train.config_checks import compression_of
    from mpidl.train.log import Logger
    from mpidl.train.task import prepare_data

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args, rest = _parser().parse_known_args(list(argv))
        if args.layouts or args.from_run or args.device or args.step_time is not None:
            return None
        preset, overrides = split_args(rest)
        check_outputs(args, [p for p in (preset,) if p and os.path.exists(p)])
        config = load_config(preset, overrides)
        check_layout(config)
        if args.compression is not None:  # the flag, as the config key would take it
            config = dataclasses.replace(config, compression=args.compression)
        choice = compression_of(config)  # ConfigError naming the value: exit 2
    except (SystemExit, ConfigError, ValueError, OSError):  # rank 0's plan reports it
        return None
    try:
        data_dir = prepare_data(config, comm, Logger())  # raises on every rank or none
    except (DataError, OSError, ValueError):
        return None
    return probe_step(comm, config, data_dir)


def _step_costs(args: argparse.Namespace, work: Workload, compute: Any, network: Any,
                node_link: Any, run: dict | None, probe: Probe | None) -> StepCosts:
    """The overlap share (a multi-rank run's achieved, else the default) and the fixed
    cost (from the probe, else 0) for the table (:mod:`mpidl.plan_step`)."""
    base = StepCosts(cores=args.cores)
    share, share_from = base.overlap_share, base.overlap_from
    if run is not None and run["ranks"] > 1:
        nodes = -(-run["ranks"] // args.ranks_per_node)
        if work.overlapped(nodes):
            comm = plan.comm_seconds(work, run["ranks"], nodes, network, node_link)
            share = achieved_overlap_share(comm, run["comm_wait_s"], run["compute_s"])
            share_from = (f"achieved by the run at {run['ranks']} ranks: waited "
                          f"{run['comm_wait_s'] * 1e3:.3g} of {comm * 1e3:.3g} ms priced")
    fixed, fixed_from = base.fixed_s, base.fixed_from
    if probe is not None:
        c = compute(probe.per_rank_batch)
        overlap = work.overlap if work.overlap is not None else probe.nodes > 1
        comm = plan.comm_seconds(work, probe.ranks, probe.nodes, network, node_link)
        fixed = fixed_cost(probe.step_s, c, exposed_comm(comm, c, overlap, share))
        fixed_from = (f"probed: {probe.steps} steps at {probe.ranks} ranks on {probe.nodes} "
                      f"node(s) took {probe.step_s * 1e3:.3g} ms, compute {c * 1e3:.3g}")
    return dataclasses.replace(base, overlap_share=share, overlap_from=share_from,
                               fixed_s=fixed, fixed_from=fixed_from)


LAYOUT_KEYS = (("tensor_parallel", 1), ("sequence_parallel", "none"),
               ("sequence_parallel_size", None), ("megatron_sequence_parallel", False),
               ("pipeline_parallel", 1))


def check_layout(config: Any) -> None:
    """ValueError if ``config`` splits the model: the planner times one rank's
    data-parallel step and prices the tensor and sequence splits itself."""
    given = [f"--{k.replace('_', '-')}={getattr(config, k)}" for k, plain in LAYOUT_KEYS
             if getattr(config, k) != plain]
    if not given:
        return
    which = ("" if config.model.name == "gpt" else
             f" (they split only the gpt model; this config's model is {config.model.name!r})")
    raise ValueError(f"{' '.join(given)}: mpidl plan times one rank's data-parallel step and "
                     "prices tensor, Ulysses and ring splits of the gpt model itself, in its "
                     f"modes table at every rank count{which}; leave out {given[0]}, or "
                     "price tensor x pipeline x data layouts with --layouts")


def _priced_ops(config: Any) -> tuple[str, ...]:
    """The collectives the table and the modes price (:mod:`mpidl.modes`)."""
    ops = ("allreduce", "reduce_scatter", "allgather")
    return ops + (("alltoall", "sendrecv") if config.model.name == "gpt" else ())


def _stand_in_note(profiles: Sequence[Any], ops: Sequence[str]) -> list[str]:
    """A note per profile whose missing collectives are priced with its allreduce's."""
    notes = []
    for profile in profiles:
        missing = profile.stand_ins(ops)
        if missing:
            notes.append(f"network profile {profile.name!r} has no numbers for "
                         f"{', '.join(missing)}: priced with its allreduce's (measure them "
                         f"with `mpidl bench --op all --save-profile {profile.name}`)")
    return notes


def _plan(argv: Sequence[str], probe: Probe | None = None) -> int:
    from hpc import costmodel

    from mpidl.data import DataError, ShardedDataset
    from mpidl.train.checkpoint import CheckpointError
    from mpidl.train.config import ConfigError, load_config, split_args
    from mpidl.train.config_checks import compression_of
    from mpidl.train.model import build_model

    parser = _parser()
    args, rest = parser.parse_known_args(list(argv))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: install the [plot] extra "
                     "(pip install 'mpidl[plot]')")
    problem = plan_layouts.flags_problem(args)
    if problem:
        parser.error(problem)
    try:  # the config file and the run read; the dataset once it is known, below
        check_outputs(args, [p for p in (*rest[:1], args.from_run) if p and os.path.exists(p)])
    except ValueError as e:
        print(f"mpidl plan: error: {e}", file=sys.stderr)
        return 2
    if args.layouts:
        return plan_layouts.plan_layouts(args, rest)
    try:
        preset, overrides = split_args(rest)
        input_s, run = 0.0, None
        if args.from_run:
            compute, input_s, run = plan.compute_from_run(args.from_run)
            config = load_config(os.path.join(args.from_run, "config.toml"), overrides)
        else:
            config = load_config(preset, overrides)
        check_layout(config)
        if args.compression is not None:  # the flag, as the config key would take it
            config = dataclasses.replace(config, compression=args.compression)
        choice = compression_of(config)  # ConfigError naming the value: exit 2
        plan.check_rank_counts(sorted(set(args.ranks)), config.global_batch)
        network = costmodel.load_network(args.network)
        node_link = (plan.shared_memory_link() if args.node_network == "shm"
                     else costmodel.load_network(args.node_network))
        notes = _stand_in_note([network, node_link], _priced_ops(config))
        device = costmodel.load_device(args.device) if args.device else None
        data_dir = plan.data_dir_for(config)
        check_outputs(args, [data_dir])
        dataset = ShardedDataset(os.path.join(data_dir, "train"))
        model = build_model(config, dataset)
    except (ConfigError, costmodel.ProfileError, ValueError, OSError, DataError,
            CheckpointError) as e:
        print(f"mpidl plan: error: {e}", file=sys.stderr)
        return 2
    samples = args.samples if args.samples is not None else len(dataset)
    epochs = args.epochs if args.epochs is not None else config.epochs
    work = plan.workload(config, model, samples, epochs)
    ranks = args.ranks
    batches = [plan.per_rank_batch(work.global_batch, r) for r in sorted(set(ranks) | {1})]
    batches += [probe.per_rank_batch] if probe is not None else []
    if args.from_run:
        basis = f"compute measured by the run {args.from_run} ({run['ranks']} ranks)"
    elif device is not None:
        flops = 6.0 * work.params

        def compute(b: int) -> float:
            return flops * b / device.flops
        basis = f"compute from FLOPs on {device.name} ({device.flops / 1e12:g} TFLOP/s " \
                f"sustained; {device.source.split(';')[0]})"
    elif args.step_time is not None:
        step, g = args.step_time, work.global_batch

        def compute(b: int) -> float:
            return step * b / g
        basis = f"a 1-rank step of {step:g} s at batch {g}, given"
    else:
        measured = plan.measure_compute(config, data_dir, batches)

        def compute(b: int) -> float:
            return measured[b]
        basis = "compute measured here (1 process, 1 BLAS thread per rank)"
    costs = _step_costs(args, work, compute, network, node_link, run, probe)
    rows = plan.predict(work, compute, ranks, network, node_link, args.ranks_per_node,
                        input_s, args.queue_hours, args.setup_hours, costs)
    line = plan.verdict(rows, args.setup_hours, args.queue_hours)
    compressed = None
    if choice is not None:
        work_c = plan.compressed_workload(work, model, choice)
        compressed = plan.predict(work_c, compute, ranks, network, node_link,
                                  args.ranks_per_node, input_s, args.queue_hours,
                                  args.setup_hours, costs)
        line_c = plan.verdict(compressed, args.setup_hours, args.queue_hours)
        change = plan.compression_verdict(rows, compressed, work_c.compressed_as,
                                          args.setup_hours, args.queue_hours)
    memory = _memory_per_rank(args, device)
    mode_rows = _modes(args, config, model, dataset, work, ranks, network, node_link, memory)
    print(f"mpidl plan: {config.model.name}, {work.params:,} parameters "
          f"({work.grad_bytes / 1e6:.1f} MB of gradient per step), {samples:,} samples x "
          f"{work.epochs:g} epochs at global batch {work.global_batch} = {work.steps:,} steps\n"
          f"network: {network.name} between nodes, {node_link.name} within "
          f"({args.ranks_per_node} rank(s) per node); {basis}\n"
          f"overlap hides {costs.overlap_share:.2f} of backward ({costs.overlap_from}); "
          f"fixed cost {costs.fixed_s * 1e3:.3g} ms per distributed step ({costs.fixed_from})"
          + (f"; {args.cores} cores shared by all ranks" if args.cores else "") + "\n")
    print(plan.format_table(rows))
    if mode_rows:
        from mpidl.modes import format_modes

        print(f"\nmodes: model state per rank, the largest model whose state fits "
              f"{memory / 1e9:.3g} GB per rank (activations not counted), "
              "communication per step\n" + format_modes(mode_rows))
    print(f"\nverdict: {line}")
    if compressed is not None:
        wire = sum(work_c.messages) if work_c.messages is not None else work.grad_bytes // 2
        print(f"\nwith --compression {work_c.compressed_as}: {wire / 1e6:.3g} MB on the wire "
              f"per step instead of {work.grad_bytes / 1e6:.3g}"
              + (f" in {len(work_c.messages)} allreduces, {work_c.extra_compute_s * 1e3:.3g} "
                 "ms of compression compute per step (measured here), the first "
                 f"{work_c.uncompressed_steps} steps uncompressed"
                 if work_c.messages is not None else "") + "\n")
        print(plan.format_table(compressed))
        print(f"\nverdict with --compression {work_c.compressed_as}: {line_c}\n{change}")
    noise = run["noise_scale"] if run else None
    if noise is not None:
        print("\n" + format_noise(noise, run["per_rank"], ranks))
    notes += plan.caveats(rows, probed=probe is not None)
    for note in notes:
        print(f"note: {note}")
    best = max(rows, key=lambda r: r.speedup)
    if args.json:
        doc = {"model": config.model.name, "params": work.params, "samples": samples,
               "epochs": work.epochs, "global_batch": work.global_batch,
               "network": network.name, "node_network": node_link.name, "basis": basis,
               "rows": [r.as_dict() for r in rows], "modes": [m.as_dict() for m in mode_rows],
               "memory_per_rank": memory, "verdict": line, "caveats": notes,
               "overlap_share": costs.overlap_share, "overlap_from": costs.overlap_from,
               "fixed_s": costs.fixed_s, "fixed_from": costs.fixed_from, "cores": args.cores,
               "best_ranks": best.ranks}
        if compressed is not None:
            doc["compression"] = {
                "how": work_c.compressed_as, "messages": list(work_c.messages or []),
                "extra_compute_s": work_c.extra_compute_s,
                "uncompressed_steps": work_c.uncompressed_steps,
                "rows": [r.as_dict() for r in compressed], "verdict": line_c,
                "change": change}
        if noise is not None:
            doc["noise_scale"] = {"value": noise, "per_rank_batch": run["per_rank"],
                                  "critical_ranks": critical_ranks(noise, run["per_rank"]),
                                  "rows": noise_rows(noise, run["per_rank"], ranks)}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
    if args.plot:
        plan.plot(rows, args.plot, f"{config.model.name} on {network.name}")
    if args.sbatch:
        return _write_sbatch(args, best)
    return 0


def _memory_per_rank(args: argparse.Namespace, device: Any) -> float:
    """Bytes of memory a rank has: ``--memory-gb``, the device's, or this node's share."""
    if args.memory_gb is not None:
        return args.memory_gb * 1e9
    if device is not None:
        return device.memory_bytes
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 0.0
    return total / args.ranks_per_node


def _modes(args: argparse.Namespace, config: Any, model: Any, dataset: Any, work: Workload,
           ranks: Sequence[int], network: Any, node_link: Any, memory: float) -> list[Any]:
    """The modes table's rows for every rank count above 1 (:mod:`mpidl.modes`)."""
    from mpidl.modes import modes_for, shape_of

    x = dataset.features.get("x")
    tokens = max(int(x.shape[-1]) - 1, 1) if x is not None and x.shape else 1  # gpt: T
    shape = shape_of(config, model, work.params, work.state_copies, tokens)
    out = []
    for r in sorted(set(ranks)):
        if r > 1:
            link = node_link if r <= args.ranks_per_node else network
            out += modes_for(shape, r, memory, link.time)
    return out


def _write_sbatch(args: argparse.Namespace, best: Prediction) -> int:
    from pathlib import Path

    from hpc import sbatch

    gpu = bool(args.device) and "gpu" in args.device
    template = "train_gpu" if gpu else "train_cpu"
    try:
        path = sbatch.find_template(template)
        profile = sbatch.load_profile("generic-gpu" if gpu else "generic-cpu")
        req = sbatch.Request(nodes=best.nodes, tasks_per_node=min(best.ranks,
                                                                  args.ranks_per_node),
                             time=_slurm_time(best.train_hours))
        text = sbatch.render(path.read_text(), profile, req,
                             (path.parent / "env.sh").read_text(),
                             template_name=f"slurm/{path.name}")
    except sbatch.RenderError as e:
        print(f"mpidl plan: error: {e}", file=sys.stderr)
        return 2
    Path(args.sbatch).write_text(text)
    print(f"batch script for {best.ranks} ranks: {args.sbatch} (sbatch {args.sbatch})")
    return 0


def _slurm_time(hours: float) -> str:
    """A generous time limit for a predicted run: 1.5x, at least 10 minutes."""
    minutes = max(10, math.ceil(hours * 60 * 1.5))
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"

