"""Training configuration: a typed schema, TOML files and presets, ``--key=value`` overrides.

``mpidl train [PRESET | CONFIG.toml] [--key=value ...]`` resolves its configuration here::

    config = load_config("reviews", ["--epochs=3", "--model.dim", "64", "--trace"])
    print(to_toml(config))            # what rank 0 prints and saves as RUN_DIR/config.toml

Sources, later ones winning: the defaults of :class:`Config`, then the preset (a TOML file
shipped in ``mpidl/presets/``) or the user's TOML file, then the command-line overrides.
Every key is checked against the schema: an unknown key, or a value of the wrong type, is
a :class:`ConfigError` that names the key (and close matches, and the expected type).

Keys. Top-level keys are training settings (``epochs``, ``lr``, ...). Two tables:

* ``[model]``: ``name`` picks the model; every other key is passed to the model's
  constructor as a keyword argument (``--model.dim=64``). Their types are checked against
  the value already there (from the preset) or else read as TOML literals (``64`` is an
  int, ``0.1`` a float, ``true`` a bool, ``[256, 256]`` a list, anything else a string).
* ``[data]``: ``path`` (a sharded dataset directory; empty: the task's generated corpus)
  and the options of the generated reviews corpus.

Shorthand: a table given a scalar sets its main key: ``--model=bow`` is
``--model.name=bow`` and ``--data=DIR`` is ``--data.path=DIR`` (also in TOML files:
``model = "bow"``). Dashes in keys are underscores (``--global-batch`` is
``global_batch``); a bool key alone is true (``--trace``), ``--no-trace`` is false;
``--steps=none`` clears an optional key.

The generic machinery (type checks, command-line parsing, TOML writing) is
:mod:`mpidl.train.schema`; the ``[model]`` keys are checked against the model's
constructor in :mod:`mpidl.train.model_keys`; this module is the schema itself and where
presets live.
"""
from __future__ import annotations

import difflib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from mpidl.data.sampler import DEFAULT_BLOCK_SIZE
from mpidl.names import PIPELINE_SCHEDULES, PRECISIONS, RECOMPUTE
from mpidl.train import optimizer_defaults
from mpidl.train.config_checks import validate
from mpidl.train.schema import (
    ConfigError,
    apply_overrides as _apply_overrides,
    apply_table,
    choices,
    parse_overrides,
    to_toml,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["Config", "ModelConfig", "DataConfig", "ConfigError", "load_config", "to_toml",
           "apply_overrides", "config_from_dict", "list_presets", "split_args",
           "parse_overrides", "default_run_dir"]

PRESET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "presets")
DEFAULT_PRESET = "reviews"
# The pipeline schedules' names are disjoint from the learning-rate schedules', so
# `schedule` takes both: a pipeline schedule's name sets `pipeline_schedule`
# (_schedule_alias).


@dataclass
class ModelConfig:
    """The ``[model]`` table: the model's name and its constructor keyword arguments."""

    name: str = "bow"                        # bow | transformer | mlp | ... (mpidl.models)
    kwargs: dict = field(default_factory=dict, metadata={"extra": True})


@dataclass
class DataConfig:
    """The ``[data]`` table: where the data comes from.

    For ``task = "reviews"`` with an empty ``path`` the corpus is generated
    (:func:`mpidl.data.synthetic.generate_reviews`), sharded once into ``cache_dir`` and
    reused by later runs with the same options.
    """

    path: str = ""                           # a sharded dataset directory ("" = generate)
    num_train: int = 25000
    num_test: int = 25000
    seq_len: int = 128                       # tokens per review (longer ones are cut)
    vocab_size: int = 8000                   # including <pad> and <unk>
    side: int = 16                           # cosmo: the fields' grid, side^3 points
    label_noise: float = 0.02
    seed: int = 0                            # the corpus seed (not the training seed)
    cache_dir: str = ".mpidl-cache"
    prefetch: int = 2                        # batches the loader reads ahead
    # The training order: "block" permutes blocks of block_size consecutive samples
    # (fast reads), "full" every sample (one read each); see mpidl.data.sampler.
    shuffle: str = choices("block", "full", default="block")
    block_size: int = DEFAULT_BLOCK_SIZE


@dataclass
class Config:
    """Everything ``mpidl train`` needs; the TOML keys are these field names.

    Learning rate: ``lr`` is the rate at ``base_batch`` (none: the optimizer's); the run
    uses :meth:`scaled_lr` (``lr_scaling``, "auto": the optimizer's published rule,
    :mod:`mpidl.train.optimizer_defaults`) with warm-up (:meth:`warmup_for`) and then the
    ``schedule`` decay to ``min_lr_ratio * lr``.
    """

    # reviews: classify the generated reviews; gpt: a language model on the generated
    # language corpus; cosmo: regress the spectra of generated 3-D Gaussian random
    # fields; custom: a dataset given with --data
    task: str = choices("reviews", "gpt", "cosmo", "custom", default="reviews")
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"main": "name"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"main": "path"})
    # -- optimisation
    epochs: int = 3
    steps: Optional[int] = None              # stop after this many optimizer steps in all
    stop_at_step: Optional[int] = None       # end THIS job after this global step, with a
    #                                          checkpoint; the schedule still spans the whole
    #                                          run and running again resumes (job chaining)
    global_batch: int = 64                   # samples per step over all ranks
    # One optimizer step over this many microbatches of each rank's share, their
    # gradients accumulated, reduced over the ranks once (mpidl.train.step.TrainStep)
    microbatches: int = 1
    lr: Optional[float] = None               # at base_batch; none: the optimizer's own
    base_batch: int = 64                     # the batch that `lr` is meant for
    # auto: the optimizer's published rule (sqrt for adam, adamw, lamb; linear for sgd,
    # lars; sources in mpidl.train.optimizer_defaults)
    lr_scaling: str = choices("auto", "linear", "sqrt", "none", default="auto")
    optimizer: str = choices("adamw", "adam", "sgd", "lars", "lamb", default="adamw")
    momentum: float = 0.9                    # sgd and lars
    weight_decay: Optional[float] = None     # none: the optimizer's own
    schedule: str = choices("cosine", "linear", "constant", default="cosine")
    warmup_steps: int = 0                    # if > 0, wins over warmup_fraction
    warmup_fraction: float = 0.05            # of all steps
    min_lr_ratio: float = 0.0                # the schedule's floor, as a fraction of lr
    clip_grad_norm: Optional[float] = None   # global L2 norm; none: no clipping
    # Datasets with floating-point targets y train by regression: squared error, or Huber
    regression_loss: str = choices("mse", "huber", default="mse")
    sync_batchnorm: bool = True              # batch norm over the global batch (SyncBatchNorm)
    # A step whose loss or gradient is not finite (on any rank) is skipped on every rank
    # with a warning; "stop" also ends the run (exit 1, the last good checkpoint kept)
    # after nonfinite_steps such steps in a row, "skip" never does.
    nonfinite: str = choices("stop", "skip", default="stop")
    nonfinite_steps: int = 10
    seed: int = 0                            # model init and dropout; data order uses it too
    # -- distribution
    backend: str = choices("numpy", "cupy", default="numpy")
    # 0: data parallelism; 1, 2, 3: ZeRO stages (sharded optimizer state, gradients,
    # parameters; mpidl.parallel.ShardedDataParallel)
    zero: int = 0
    # gpt only: split the model over a tensor x sequence grid (data parallelism over the
    # rest of the ranks; mpidl.parallel.ParallelGPT). tensor_parallel: ranks per layer
    # (Megatron); sequence_parallel: how a sequence is split, "ulysses" (all-to-all) or
    # "ring" (blockwise attention), over sequence_parallel_size ranks (none: all ranks
    # the tensor split leaves); megatron_sequence_parallel: LayerNorm and dropout regions
    # split along the sequence within the tensor group (Megatron's sequence parallelism)
    tensor_parallel: int = 1
    sequence_parallel: str = choices("none", "ulysses", "ring", default="none")
    sequence_parallel_size: Optional[int] = None
    megatron_sequence_parallel: bool = False
    # gpt only: the model's layers in pipeline_parallel stages (the outermost axis), each
    # step's share cut into `microbatches` (at least the stages) run by pipeline_schedule;
    # interleaved runs virtual_stages model chunks per rank (mpidl.parallel.pipeline).
    # `schedule` takes these names too: --schedule=1f1b sets pipeline_schedule.
    pipeline_parallel: int = 1
    pipeline_schedule: str = choices(*PIPELINE_SCHEDULES, default="1f1b")
    virtual_stages: int = 1
    # Activation recomputation of transformer blocks: none, selective (the attention
    # scores and probabilities), full (each block keeps its input); mpidl.nn.recompute
    recompute: str = choices(*RECOMPUTE, default="none")
    # Mixed precision: fp16 or bf16 parameters and activations, fp32 master weights and
    # optimizer state (sharded under ZeRO), gradients reduced in fp32
    # (mpidl.optim.MasterWeights). loss_scale: auto is dynamic for fp16 (and for
    # --model.dtype=float16 parameters), none for bf16 and fp32 (as Megatron)
    precision: str = choices(*PRECISIONS, default="fp32")
    loss_scale: str = choices("auto", "dynamic", "none", default="auto")
    # backend cupy: float32 GEMMs in TF32 on the tensor cores (10-bit mantissa inputs,
    # fp32 sums) instead of full FP32; the job's choice, whatever CUPY_TF32 says
    # (mpidl.backend.use_tf32); the planner prices what is chosen
    tf32: bool = False
    bucket_mb: Optional[float] = None        # gradient bucket MiB; none: DataParallel's default
    keep_freed_memory: bool = True           # glibc keeps freed memory (no page faults
    #                                          re-fetching each step's activations)
    overlap: Optional[bool] = None           # bucket allreduces during backward; none: on
    #                                          when the ranks span several nodes
    # Gradients on the wire (mpidl.parallel.compression_choice): none, fp16, bf16, or
    # powersgd:R, a rank-R approximation with error feedback (data parallelism only);
    # PowerSGD's uncompressed first steps, warm start and error feedback as PyTorch's
    # start_powerSGD_iter, warm_start, use_error_feedback (and their defaults)
    compression: str = "none"
    start_powersgd_iter: int = 1000
    powersgd_warm_start: bool = True
    powersgd_error_feedback: bool = True
    # -- run directory, checkpoints, logging
    run_dir: str = ""                        # "" = runs/<task>-<model>-<time>
    resume: Union[bool, str] = "auto"        # auto | true | false | PATH (see resume docs)
    checkpoint_every: int = 0                # steps between checkpoints; 0 = at epoch ends only
    checkpoint_epochs: bool = True           # also checkpoint at the end of each epoch
    keep_checkpoints: int = 3
    eval_every: int = 1                      # epochs between evaluations (and after the last)
    log_every: int = 50                      # steps between metrics records
    trace: bool = False                      # write RUN_DIR/trace.json (Chrome trace)
    progress: str = choices("auto", "always", "never", default="auto")
    # Seconds a collective may wait before the watchdog ends the job with a report of
    # every rank (mpidl.comm.watchdog); none: MPIDL_TIMEOUT, else 600; 0: off.
    timeout: Optional[float] = None
    # At the end, train the linear model (logistic regression on token counts or on
    # standardised features) on the same splits and print its test score beside the
    # model's, when the train split is small enough to fit it in seconds ("auto";
    # mpidl.train.baseline); "off": never
    baseline: str = choices("auto", "off", default="auto")

    def scaled_lr(self) -> float:
        """``lr`` (or the optimizer's) scaled from ``base_batch`` to ``global_batch`` by
        ``lr_scaling`` (or, for "auto", the optimizer's rule)."""
        rules = optimizer_defaults
        return rules.scale(rules.base_lr(self.optimizer, self.lr),
                           rules.scaling_rule(self.optimizer, self.lr_scaling),
                           self.global_batch, self.base_batch)

    def decay(self) -> float:
        """``weight_decay``, or the optimizer's default when it is none."""
        return optimizer_defaults.weight_decay(self.optimizer, self.weight_decay)

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps of a run of ``total_steps`` (``warmup_steps`` or the fraction)."""
        if self.warmup_steps > 0:
            return min(self.warmup_steps, total_steps)
        return min(int(round(self.warmup_fraction * total_steps)), total_steps)


def config_from_dict(table: dict) -> Config:
    """A validated Config from a parsed TOML document (a dict of dicts)."""
    config = Config()
    if table.get("schedule") in PIPELINE_SCHEDULES:  # schedule = "1f1b": the pipeline's
        table = {**table, "pipeline_schedule": table["schedule"]}
        del table["schedule"]
    apply_table(config, table)
    validate(config)
    return config


# -- presets, files, overrides ------------------------------------------------------------

def list_presets() -> list[str]:
    """Names of the presets shipped in ``mpidl/presets``."""
    if not os.path.isdir(PRESET_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".toml"))


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} "
                          f"at offset {e.start}): a TOML config is a text file; pass the run's "
                          "config.toml or a preset name") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a directory; pass a .toml file or a "
                          "preset name") from None


def _source_path(preset_or_path: str) -> str:
    if (preset_or_path.endswith(".toml") or os.sep in preset_or_path
            or os.path.isfile(preset_or_path)):
        return preset_or_path
    presets = list_presets()
    if preset_or_path not in presets:
        close = difflib.get_close_matches(preset_or_path, presets, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"no preset or file named {preset_or_path!r}{hint} "
                          f"(presets: {', '.join(presets)}; a config file ends in .toml)")
    return os.path.join(PRESET_DIR, preset_or_path + ".toml")


def split_args(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Split ``mpidl train`` arguments into the optional leading PRESET/FILE and overrides."""
    argv = list(argv)
    if argv and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


def _schedule_alias(overrides: Sequence[str]) -> list[str]:
    """``--schedule=1f1b`` (or ``--schedule 1f1b``) as ``--pipeline-schedule=1f1b``: the
    key names the learning-rate schedule (cosine, linear, constant) and, by a value of
    :data:`PIPELINE_SCHEDULES` (disjoint names), the pipeline's."""
    out, args = [], list(overrides)
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if not eq and key == "--schedule" and i + 1 < len(args):
            value = args[i + 1]
        if key == "--schedule" and value in PIPELINE_SCHEDULES:
            out.append("--pipeline-schedule" + (eq and "=" + value))
        elif key == "--schedule" and value not in ("cosine", "linear", "constant"):
            raise ConfigError(f"--schedule={value!r} is neither a learning-rate schedule "
                              "(cosine, linear, constant) nor a pipeline schedule (gpipe, "
                              "1f1b, interleaved: --pipeline-schedule)")
        else:
            out.append(arg)
    return out


def apply_overrides(config: Config, overrides: Sequence[str]) -> Config:
    """Apply command-line overrides to ``config`` in place (checked, validated); return it."""
    _apply_overrides(config, _schedule_alias(overrides))
    validate(config)
    return config


def load_config(preset_or_path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """Resolve the configuration of a run.

    Args:
        preset_or_path: a preset name (``reviews``; see :func:`list_presets`) or a TOML
            file path; None means the default preset ``reviews``.
        overrides: command-line ``--key=value`` / ``--key value`` / ``--flag`` arguments.

    Raises:
        ConfigError: missing file, unknown preset, invalid TOML, unknown key, wrong type
            or out-of-range value; the message names the file or key.
    """
    path = _source_path(preset_or_path or DEFAULT_PRESET)
    data = _read_toml(path)
    config = apply_overrides(config_from_dict(data), overrides)
    if config.optimizer != data.get("optimizer", config.optimizer):
        # The file's rate and decay were chosen for its own optimizer (a preset's AdamW
        # rate and decay wreck LARS): another optimizer from the command line brings its
        # own, unless they are given there too.
        for key in ("lr", "weight_decay"):
            flag = "--" + key.replace("_", "-")
            if not any(a in (flag, "--" + key) or a.startswith((flag + "=", f"--{key}="))
                       for a in overrides):
                setattr(config, key, None)
    return config


def default_run_dir(config: Config, job_id: str | None = None, stamp: str | None = None) -> str:
    """``runs/<task>-<model>-<job id or time stamp>`` for ``run_dir = ""``.

    A Slurm job keeps its id when it is requeued, so a preempted job that is requeued
    finds its own run directory and resumes; elsewhere the stamp (agreed across ranks:
    rank 0's, broadcast) makes each run a new directory.
    """
    suffix = job_id or stamp or time.strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"{config.task}-{config.model.name}-{suffix}")
