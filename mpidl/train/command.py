"""``mpidl train``: the main job, under ``mpirun``/``srun``.

Run::

    mpiexec -n 2 mpidl train                       # the built-in reviews task
    mpiexec -n 4 mpidl train reviews-transformer --epochs=3 --run-dir=runs/tf
    srun --mpi=pmix mpidl train my.toml --lr=3e-4  # a TOML config plus overrides
    mpidl train --help                             # every key and its value (reviews)
    mpidl train reviews-transformer --help         # ... as that preset sets them
    mpiexec -n 2 mpidl eval runs/tf                # evaluate it (mpidl.train.inference)

``--schedule`` names the learning-rate schedule (cosine, linear, constant) or the pipeline
schedule (gpipe, 1f1b, interleaved: it sets ``pipeline_schedule``; the names do not
overlap). Pipelines and recomputation: ``mpidl train gpt --pipeline-parallel 2
--microbatches 4 --recompute selective`` (docs/parallelism.md).

Exit codes (the same on every rank): 0 done; 2 a configuration or data error (unknown
key, wrong type, missing file, a dataset that is corrupt or whose splits disagree: one
message, from rank 0); 75 (EX_TEMPFAIL) preempted by SIGTERM/SIGUSR1 — after writing a
checkpoint once training has begun, with nothing left behind before — run the same
command again to resume; 1 any other error (a diverged run keeps 1 if also signalled).

The SIGTERM/SIGUSR1 handlers are this command's first instruction, before any heavy
import, and stay until the process ends (:mod:`mpidl.train.signals`): from then on a
signal is a request to stop that every phase honours at its next safe point. So this
module imports inside its functions (the imports marked "lazy"): NumPy, MPI and h5py
load after the handlers are in place, and ``mpidl train --help`` loads no engine.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

EXIT_CONFIG = 2


def _help(argv: Sequence[str]) -> str:
    """The docstring, the presets, and every key as the given preset (and overrides) set
    it: what the same command line without --help would run."""
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.train.config import (DEFAULT_PRESET, ConfigError, list_presets, load_config,
                                    split_args, to_toml)
    from mpidl.train.optimizer_defaults import describe

    rest = [a for a in argv if a not in ("-h", "--help")]
    try:
        preset, overrides = split_args(rest)
        shown = to_toml(load_config(preset, overrides))
        name = preset or DEFAULT_PRESET
    except ConfigError as e:
        shown, name = f"# {e}\n", "?"
    return (__doc__ + "\n" + describe() + "\nPresets: " + ", ".join(list_presets()) +
            f"\n\nKeys as `{name}` sets them (TOML; override any as --key=value, tables "
            "as --model.dim=64):\n\n" + shown)


def _resolve(argv: Sequence[str], comm) -> tuple[object | None, int]:
    """Load the config on every rank; on any error, rank 0 reports it once. Collective."""
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.backend import precision_problem
    from mpidl.train.config import ConfigError, load_config, split_args
    from mpidl.train.data_fit import fit_to_data
    from mpidl.train.model_keys import check_model

    config, error, chosen = None, None, []
    try:
        preset, overrides = split_args(argv)
        config = load_config(preset, overrides)
        # a user's dataset with no preset: the model and epochs follow it (data_fit)
        chosen = fit_to_data(config, preset, overrides)
        check_model(config)
        error = precision_problem(config.backend, config.precision)  # CuPy's bf16 (#48)
    except ConfigError as e:
        error = str(e)
    if _config_error(comm, error):
        return None, EXIT_CONFIG
    if comm.rank == 0:
        for line in chosen:
            print(f"mpidl train: {line}", flush=True)
    return config, 0


def _config_error(comm, error: str | None) -> bool:
    """Whether any rank has a configuration error; rank 0 reports the first. Collective."""
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.train.log import report_first_error

    return report_first_error(comm, error, "mpidl train")


def _trainer(config, comm, run_dir: str, data_dir: str):
    """The Trainer, or None if the dataset is unusable: rank 0 reports it once. Collective.

    A DataError (a missing or corrupt shard, splits that disagree) is raised by every
    rank alike (the dataset's checks are collective, and every rank reads the same
    manifests), so it is reported like a configuration error, not as a crash per rank.
    """
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.data import DataError
    from mpidl.train.config import ConfigError
    from mpidl.train.trainer import Trainer

    trainer, error = None, None
    try:
        trainer = Trainer(config, comm, run_dir, data_dir)
    except (DataError, ConfigError) as e:  # a model option the data contradicts, too
        error = str(e)
    return None if _config_error(comm, error) else trainer


def _run_dir(config, comm) -> str:
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.train.config import default_run_dir

    if config.run_dir:
        return config.run_dir
    stamp = comm.bcast_obj(time.strftime("%Y%m%d-%H%M%S") if comm.rank == 0 else None)
    return default_run_dir(config, os.environ.get("SLURM_JOB_ID"), stamp)


def _run_dir_problem(run_dir: str, comm) -> str | None:
    # Before the data is made and the model built: a file there (or on the way to it) or
    # a read-only filesystem is bad input, not a full disk found after the work. On every
    # rank: each writes its pieces of a sharded checkpoint there.
    from hpc.argtypes import output_dir_problem

    problem = output_dir_problem(run_dir)
    if problem is None:
        return None
    return (f"rank {comm.rank}: " if comm.size > 1 else "") + f"run directory {problem}"


def main(argv: Sequence[str]) -> int:
    """``mpidl train [PRESET | CONFIG.toml] [--key=value ...]``. Collective."""
    if any(a in ("-h", "--help") for a in argv):
        print(_help(argv))
        return 0
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.train.signals import EXIT_PREEMPTED, PreemptionFlag, Preempted

    # First, before NumPy and MPI load: a signal from here on stops the job with 75.
    # Never closed: the job owns the process, and a signal after a restored default
    # handler would kill a rank that has done its work (status 138, not 75).
    preempt = PreemptionFlag()
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.comm import world

    comm = world()
    try:
        code = _train(argv, comm, preempt)
    except Preempted as e:
        if comm.rank == 0:
            print(f"mpidl train: preempted ({_which(preempt)}) while {e.during}, "
                  f"before training began: nothing to save, the run directory is as it "
                  f"was; exiting with {EXIT_PREEMPTED} to be requeued", flush=True)
        return EXIT_PREEMPTED
    # Trained to the end (0): a signal during the last evaluation, checkpoint or summary
    # still ends the job with 75, as asked; run again, it finds nothing left to do.
    if code == 0 and preempt.agree(comm):
        if comm.rank == 0:
            print(f"mpidl train: preempted ({_which(preempt)}) after the last step of "
                  f"this attempt, its checkpoint written; exiting with {EXIT_PREEMPTED} "
                  "as asked", flush=True)
        return EXIT_PREEMPTED
    return code


def _which(preempt) -> str:
    return preempt.signal_name or "signal on another rank"


def _train(argv: Sequence[str], comm, preempt) -> int:
    """The job after its signal handlers: :class:`~mpidl.train.signals.Preempted` on
    every rank at a safe point before training, or the exit status. Collective."""
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.comm import watchdog
    from mpidl.train.config import ConfigError, to_toml
    from mpidl.train.task import prepare_data

    config, code = _resolve(argv, comm)
    if config is None:
        return code
    preempt.check(comm, "starting")
    if config.timeout is not None:
        watchdog.set_timeout(config.timeout or float("inf"))  # 0: no timeout
    run_dir = _run_dir(config, comm)
    if _config_error(comm, _run_dir_problem(run_dir, comm)):
        return EXIT_CONFIG
    text = to_toml(config)
    if comm.rank == 0:
        print(f"mpidl train on {comm.size} rank{'s' if comm.size > 1 else ''}, "
              f"run directory {run_dir}\n--- config ---\n{text.rstrip()}\n--------------",
              flush=True)
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.train.log import Logger

    data_dir = prepare_data(config, comm, Logger(comm.rank, comm.size),
                            stop=lambda: preempt.is_set)
    preempt.check(comm, "preparing the data")
    trainer = _trainer(config, comm, run_dir, data_dir)
    if trainer is None:
        return EXIT_CONFIG
    preempt.check(comm, "building the model")
    plan = _plan(config, run_dir, comm)
    if plan is None:
        return EXIT_CONFIG
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.train.checkpoint import CheckpointError  # as _plan: h5py when needed

    while plan.checkpoint is not None:
        error = None
        try:
            trainer.restore(plan.checkpoint)
        except ConfigError as e:  # another model, another sample order: the same everywhere
            error = str(e)
        except CheckpointError as e:  # a damaged part, found by the rank that reads it
            if config.resume not in (True, "auto"):
                error = str(e)  # the checkpoint asked for: no other will do
            else:  # as rank 0's choice does with a damaged file: the next older one
                plan = _plan(config, run_dir, comm, bad=[*plan.corrupt,
                                                         (plan.checkpoint.path, str(e))])
                if plan is None:
                    return EXIT_CONFIG
                continue
        if _config_error(comm, error):
            return EXIT_CONFIG
        break
    preempt.check(comm, "loading the checkpoint to resume from")
    # Only now, with the resume accepted, does the run directory change.
    trainer.begin(text, corrupt=plan.corrupt, previous=plan.previous)
    code = trainer.fit(preempt)
    if code == 0 and trainer.step >= trainer.total_steps and not preempt.is_set:
        _baseline(config, comm, data_dir, trainer)
    return code


def _baseline(config, comm, data_dir: str, trainer) -> None:
    """Where ``--baseline auto`` and the data is small: the linear model's test score
    beside the model's (:mod:`mpidl.train.baseline`). Collective."""
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.train import baseline

    if trainer.last_evaluation is None or not baseline.wanted(config, trainer.train_set):
        return
    scores, epochs, seconds = baseline.fit_baseline(config, comm, data_dir,
                                                    len(trainer.train_set))
    key, label = trainer.objective.final_scores[0]
    if comm.rank == 0:
        tokens = trainer.train_set.features["x"].dtype.kind in "iu" and \
            bool(trainer.train_set.vocab)
        print(baseline.describe(config.model.name, tokens, scores,
                                trainer.last_evaluation.record.get(key), epochs, seconds,
                                key, label), flush=True)


def _plan(config, run_dir: str, comm, bad=()):
    """Where the run starts (:func:`~mpidl.train.checkpoint.plan_resume`), on every rank;
    None after reporting a configuration error. Collective.

    Rank 0 chooses (a single file's checksums checked, a sharded one's index read and
    its parts found); the others read the chosen index or file themselves. Nobody reads
    the state here: :meth:`Trainer.restore` reads each rank's share. ``bad``:
    checkpoints found damaged while restoring, ``(path, reason)``: passed over, and set
    aside with the others once a resume succeeds.
    """
    # lazy: the signal handlers come before heavy imports (see the module's note)
    from mpidl.train.checkpoint import (CheckpointError, ResumePlan, load_checkpoint,
                                        plan_resume)

    plan, error = None, None
    if comm.rank == 0:
        try:
            plan = plan_resume(config.resume, run_dir, state="none", bad=list(bad))
        except (FileNotFoundError, CheckpointError) as e:
            error = str(e)
    if _config_error(comm, error):
        return None
    path, corrupt, previous = comm.bcast_obj(None if plan is None else (
        plan.checkpoint.path if plan.checkpoint else None, plan.corrupt, plan.previous))
    state = plan.checkpoint if plan is not None else None
    if comm.rank != 0 and path is not None:
        try:
            state = load_checkpoint(path, "none")
        except (FileNotFoundError, CheckpointError) as e:
            error = f"rank {comm.rank}: {e}"
    if _config_error(comm, error):
        return None
    return ResumePlan(state, corrupt, previous)
