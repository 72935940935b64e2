"""Building a run: from the configuration and the dataset to the parts that train.

:func:`build_run` makes, on every rank, what one training run is made of: the splits,
the objective, the model on its layout (whole, or split over a tensor x sequence grid),
the wrapper that averages gradients (data parallel or ZeRO), the optimizer, the loaders,
the loss scale and the dropout generators. It reads the dataset and nothing else: it
touches no run directory and writes no file, so the planner builds a run to time its
step (:class:`~mpidl.train.step.TrainStep`) and ``mpidl train`` builds one before it
decides where to resume from.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import numpy

from hpc.gpu import bind
from mpidl import optim
from mpidl.backend import get_xp, is_half, limit_cpu_threads, precision_dtype, use_tf32
from mpidl.data import DataLoader, DistributedSampler, ShardedDataset
from mpidl.data.splits import check_splits_agree
from mpidl.data.stats import majority
from mpidl.nn import init
from mpidl.nn.recompute import set_recompute
from mpidl.parallel import DataParallel, ShardedDataParallel, convert_sync_batchnorm
from mpidl.train.config import Config, ConfigError
from mpidl.train.config_checks import compression_of
from mpidl.train.evaluation import evaluation_loader
from mpidl.train.layout import Layout, plan_layout
from mpidl.train.log import Logger
from mpidl.train.model import build_model, seed_dropout_per_rank, unscaled_note
from mpidl.train.noise import LocalGradients
from mpidl.train.objective import Objective, objective_for


@dataclasses.dataclass
class Run:
    """The parts of one training run on this rank (:func:`build_run`).

    Attributes:
        config: the resolved configuration.
        comm: the world communicator.
        xp: the array module (numpy or cupy).
        threads: the BLAS threads per rank set here (None: left as the environment has it).
        train_set, test_set: the dataset's splits.
        objective: what is learned and how it is scored (split over the grid if any).
        layout: the run's communicators: data, replicas, and the grid when split.
        model: the model this rank trains (its shards on a grid, or its stage's parts:
            a :class:`~mpidl.parallel.PipelineModel` that runs the step's microbatches),
            on ``xp``.
        dp: the wrapper that averages gradients over ``layout.replicas`` (with a
            pipeline: the stage's, ``model.wrapped``).
        optimizer: over ``dp.parameters()`` (the model's, or this rank's ZeRO shards).
        loader: the training batches of this rank's share (its sampler: seed, epoch).
        eval_loader: every test sample once, in order.
        loss_scale: a :class:`~mpidl.optim.DynamicLossScale` for float16 parameters
            (``--precision fp16``, or ``--model.dtype=float16``; ``--loss-scale``),
            else None.
        total_steps: optimizer steps of the whole run (``epochs`` or ``steps``).
        local_grads: this rank's gradient norm before averaging, for the gradient noise
            scale (:mod:`mpidl.train.noise`), or None where it is not measured.
    """

    config: Config
    comm: Any
    xp: Any
    threads: int | None
    train_set: ShardedDataset
    test_set: ShardedDataset
    objective: Objective
    layout: Layout
    model: Any
    dp: Any
    optimizer: Any
    loader: DataLoader
    eval_loader: DataLoader
    loss_scale: Any
    total_steps: int
    local_grads: LocalGradients | None = None

    def close(self) -> None:
        """Stop the wrapper's communication (its transport threads). Not collective."""
        self.dp.close()


def check_splits(train: Any, test: Any, needed: tuple[str, ...] = ("x", "y")) -> None:
    """What the trainer reads: features ``x`` (inputs) and ``y`` (labels; a language
    model reads ``x`` only), some samples."""
    for split in (train, test):
        missing = [name for name in needed if name not in split.features]
        if missing:
            what = " and ".join(f"{n!r}" for n in needed)
            raise ValueError(
                f"dataset {split.path} has features {sorted(split.features)}, but the "
                f"trainer reads {what}: write the split with those names "
                f"(missing: {', '.join(missing)})")
    if len(train) == 0:
        raise ValueError(f"dataset {train.path} has no samples: nothing to train on; "
                         f"write a non-empty train split")
    # Features, vocabulary, classes.
    check_splits_agree({train.path: train.manifest, test.path: test.manifest})


def warn_if_one_class_dominates(train_set: Any, log: Logger) -> None:
    """Say so when always guessing one class scores high: the accuracy to beat.

    "Dominates": more than halfway from a balanced share to all of them (75% of 2
    classes, 55% of 10), where a high accuracy stops meaning the model learned.
    """
    found = majority(train_set.manifest)
    classes = train_set.num_classes or 0
    if found is None or classes < 2:
        return
    name, share = found
    if share >= 0.5 + 0.5 / classes:
        log.info(f"warning: one class dominates the training data: {name!r} is "
                 f"{share:.0%} of {train_set.path}; always guessing it scores "
                 f"{share:.2f}, the accuracy a model must beat")


def build_optimizer(config: Config, params: list, norms: Any = None) -> Any:
    """The configured optimizer over ``params`` at the scaled base learning rate;
    ``norms``: where the model's tensors are (:class:`~mpidl.optim.TensorNorms`), for
    the layer-wise LARS and LAMB (None: every parameter a whole tensor)."""
    lr = config.scaled_lr()
    if config.optimizer == "sgd":
        return optim.SGD(params, lr=lr, momentum=config.momentum,
                         weight_decay=config.decay())
    if config.optimizer == "lars":
        return optim.LARS(params, lr=lr, momentum=config.momentum,
                          weight_decay=config.decay(), norms=norms)
    if config.optimizer == "lamb":
        return optim.LAMB(params, lr=lr, weight_decay=config.decay(), norms=norms)
    cls = optim.AdamW if config.optimizer == "adamw" else optim.Adam
    return cls(params, lr=lr, weight_decay=config.decay())


def check_microbatches(config: Config, data_ranks: int) -> None:
    """ConfigError unless every data rank's share of a step has a sample per microbatch
    (the smallest share, ``global_batch // data_ranks``; alike on every rank)."""
    share = config.global_batch // data_ranks
    if config.microbatches > share:
        raise ConfigError(
            f"--microbatches={config.microbatches} is more than the {share} sample(s) the "
            f"smallest of {data_ranks} data ranks gets of --global-batch="
            f"{config.global_batch}: use --microbatches={max(share, 1)} or fewer, or a "
            f"--global-batch of at least {config.microbatches * data_ranks}")


def apply_recompute(config: Config, model: Any) -> None:
    """Set the model's transformer blocks to recompute as ``config.recompute`` says
    (:func:`~mpidl.nn.recompute.set_recompute`); ConfigError for a model without any."""
    if config.recompute == "none":
        return  # what the model was built with (--model.recompute, if it takes one)
    try:
        set_recompute(model, config.recompute)
    except ValueError as e:
        raise ConfigError(f"--recompute={config.recompute}: the {config.model.name!r} model "
                          "has no transformer blocks to recompute; use --recompute=none, or "
                          "a model with blocks (transformer, gpt)") from e


def loss_scale_for(config: Config, params: Any) -> Any:
    """A :class:`~mpidl.optim.DynamicLossScale` where float16 gradients need one (fp16
    mixed precision, float16 parameters) or ``--loss-scale dynamic`` asks; else None
    (bfloat16 has float32's range: Megatron scales it only when asked)."""
    if config.loss_scale == "none":
        return None
    float16 = config.precision == "fp16" or any(p.data.dtype == numpy.float16 for p in params)
    return optim.DynamicLossScale() if float16 or config.loss_scale == "dynamic" else None


def build_run(config: Config, comm: Any, data_dir: str, log: Logger | None = None) -> Run:
    """The parts of a run of ``config`` on ``data_dir`` (with ``train/`` and ``test/``
    splits). Collective over ``comm`` (the dataset's checks, the grid's communicators).

    Raises ConfigError for an impossible layout or a model option the data
    contradicts, DataError or ValueError for unusable data (alike on every rank).
    """
    log = log if log is not None else Logger(comm.rank, comm.size)
    xp = get_xp(config.backend)
    threads = limit_cpu_threads(comm.local_size)
    if config.backend == "cupy":
        bind(comm.local_rank)
        use_tf32(xp, config.tf32)
    train_set = ShardedDataset(os.path.join(data_dir, "train"), comm=comm)
    test_set = ShardedDataset(os.path.join(data_dir, "test"), comm=comm)
    objective = objective_for(config, train_set)
    # The same files: alike on every rank.
    check_splits(train_set, test_set, objective.features)
    warn_if_one_class_dominates(train_set, log)
    note = unscaled_note(config, train_set)
    if note:
        log.info(note)
    pipelined = config.pipeline_parallel > 1
    # A pipeline's layout is checked against the model's shapes (no values drawn); each
    # rank then builds its stage's layers only, below.
    with init.skipped(draw=False) if pipelined else contextlib.nullcontext():
        model = build_model(config, train_set)
    if config.precision != "fp32" and any(is_half(p.data.dtype) for p in model.parameters()):
        raise ConfigError(f"--precision={config.precision} with 16-bit model parameters "
                          "(--model.dtype): the first keeps fp32 master weights, the second "
                          "trains the half parameters themselves; choose one")
    apply_recompute(config, model)
    # Where the model lives: whole on every rank, split over a tensor x sequence grid,
    # or in pipeline stages (mpidl.train.layout); an impossible layout is a ConfigError
    # (exit 2).
    length = max(int(train_set.features["x"].shape[-1]) - 1, 1) if config.task == "gpt" else 1
    layout = Layout(plan_layout(config, comm.size, model, length), comm)
    check_microbatches(config, layout.data.size)
    if pipelined:
        # This stage's layers from the seed, the values of the whole build (GPT(keep=)):
        # a stage never holds the whole model, not even while it is built.
        model = build_model(config, train_set, keep=layout.stage_keeps(model))
        apply_recompute(config, model)
    if layout.grid is not None:
        objective = objective.split_over(layout.grid)
        log.info(f"model layout: {layout.plan.describe()}")
    # Before the split: the shards' dropout keeps the full model's generators, the
    # same on every rank of a replica, one of its own on every data rank.
    seed_dropout_per_rank(model, config.seed, layout.data.rank)

    def wrap(module: Any, replicas: Any) -> Any:
        """The wrapper that averages ``module``'s gradients over ``replicas``."""
        options = {} if config.bucket_mb is None else {"bucket_mb": config.bucket_mb}
        options["compression"] = compression_of(config)
        if config.precision != "fp32":  # half parameters, their gradients in fp32
            module.half_(precision_dtype(config.precision))
            options["grad_dtype"] = "float32"
        if config.zero:
            return ShardedDataParallel(module, replicas, stage=config.zero,
                                       keep_freed_memory=config.keep_freed_memory, **options)
        return DataParallel(module, replicas, overlap=config.overlap,
                            keep_freed_memory=config.keep_freed_memory, **options)
    if layout.plan.pipeline > 1:
        # The stage's parts (the stage-built model's own modules) move to the device once
        # cut and are wrapped inside the PipelineModel; the trainer's wrapper is that
        # one: its parameters are this stage's.
        model = layout.split_model(model, wrap, xp)
        dp = model.wrapped
        local_grads = None
    else:
        model = layout.split_model(model).to(xp)
        if config.sync_batchnorm and layout.replicas.size > 1:
            convert_sync_batchnorm(model, layout.replicas)  # no-op without batch norm layers
        # Before the wrapper's hooks (hooks run in registration order): the local
        # gradients are read before their bucket is sent.
        local_grads = LocalGradients(model.parameters()) if measures_noise(config, layout) \
            else None
        dp = wrap(model, layout.replicas)  # gradients are averaged over the replicas
    # What the optimizer updates: the model's parameters, or this rank's shards.
    optimizer = build_optimizer(config, dp.parameters(), layout.tensor_norms(dp))
    if config.precision != "fp32":
        optimizer = optim.MasterWeights(optimizer)  # updates fp32 masters of the halves
    data = layout.data  # every rank of a tensor x sequence group reads the same
    sampler = DistributedSampler(len(train_set), config.global_batch, data.rank, data.size,
                                 seed=config.seed, shuffle=config.data.shuffle,
                                 block_size=config.data.block_size)
    loader = DataLoader(train_set, sampler, objective.features, xp=xp,
                        prefetch=config.data.prefetch)
    eval_loader = evaluation_loader(test_set, data, xp, config.data.prefetch,
                                    objective.features)
    steps = config.epochs * len(loader)
    total_steps = min(steps, config.steps) if config.steps else steps
    loss_scale = loss_scale_for(config, dp.parameters())
    return Run(config=config, comm=comm, xp=xp, threads=threads, train_set=train_set,
               test_set=test_set, objective=objective, layout=layout, model=model, dp=dp,
               optimizer=optimizer, loader=loader, eval_loader=eval_loader,
               loss_scale=loss_scale, total_steps=total_steps, local_grads=local_grads)


def measures_noise(config: Config, layout: Layout) -> bool:
    """Whether the run measures the gradient noise scale: data parallelism or ZeRO of a
    whole model over several ranks, one microbatch a step (each rank's gradient is then
    one small-batch estimate; a split model's or an accumulation's local gradient is
    not, and is not measured)."""
    return layout.grid is None and layout.replicas.size > 1 and config.microbatches == 1


__all__ = ["Run", "apply_recompute", "build_run", "build_optimizer", "check_microbatches",
           "measures_noise",
           "check_splits", "warn_if_one_class_dominates"]
