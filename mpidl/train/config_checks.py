"""The checks of a training configuration that its types cannot express: ranges, keys
that need each other, and the generated corpora's own limits.

:func:`validate` is called on every :class:`~mpidl.train.config.Config` that
:func:`~mpidl.train.config.load_config` or :func:`~mpidl.train.config.apply_overrides`
returns; it raises :class:`~mpidl.train.schema.ConfigError` naming the key, the value
and what it must be (exit 2 in ``mpidl train``).
"""
from __future__ import annotations

from typing import Any

from hpc.argtypes import number_problem
from mpidl.train.schema import ConfigError


def validate(config: Any) -> None:
    """Range checks that a type cannot express; ConfigError naming the key, the value
    and what it must be."""
    positive = ["epochs", "global_batch", "base_batch", "keep_checkpoints", "eval_every",
                "log_every", "nonfinite_steps", "microbatches"]
    for key in positive:
        if getattr(config, key) < 1:
            raise ConfigError(f"config key {key!r} must be >= 1, got {getattr(config, key)}")
    for key in ("checkpoint_every", "warmup_steps"):
        if getattr(config, key) < 0:
            raise ConfigError(f"config key {key!r} must be >= 0, got {getattr(config, key)}")
    for key in ("steps", "stop_at_step"):
        if getattr(config, key) is not None and getattr(config, key) < 1:
            raise ConfigError(f"config key {key!r} must be >= 1 or none, "
                              f"got {getattr(config, key)}")
    if config.microbatches > config.global_batch:
        raise ConfigError(f"--microbatches={config.microbatches} is more than the "
                          f"--global-batch={config.global_batch} samples of a step: a "
                          f"microbatch needs a sample; use at most {config.global_batch}")
    if config.zero not in (0, 1, 2, 3):
        raise ConfigError(f"config key 'zero' must be 0 (data parallelism) or a ZeRO stage 1, 2 "
                          f"or 3, got {config.zero}")
    for key in ("pipeline_parallel", "virtual_stages"):
        if getattr(config, key) < 1:
            raise ConfigError(f"config key {key!r} must be >= 1, got {getattr(config, key)}")
    if config.tensor_parallel < 1:
        raise ConfigError(f"config key 'tensor_parallel' must be >= 1 (ranks per layer), "
                          f"got {config.tensor_parallel}")
    if config.sequence_parallel_size is not None and config.sequence_parallel_size < 1:
        raise ConfigError(f"config key 'sequence_parallel_size' must be >= 1 or none, "
                          f"got {config.sequence_parallel_size}")
    for key, strict, note in (("lr", True, " or none"), ("weight_decay", False, " or none"),
                              ("bucket_mb", True, " or none"),
                              ("clip_grad_norm", True, " or none"),
                              ("timeout", False, " (seconds; 0: no watchdog) or none")):
        value = getattr(config, key)
        problem = None if value is None else number_problem(value, 0, strict)
        if problem:
            raise ConfigError(f"config key {key!r} {problem}{note}, got {value}")
    if not 0.0 <= config.min_lr_ratio <= 1.0:
        raise ConfigError(f"config key 'min_lr_ratio' must be in [0, 1] (the schedule's "
                          f"floor as a fraction of lr), got {config.min_lr_ratio}")
    if not 0.0 <= config.momentum < 1.0:
        raise ConfigError(f"config key 'momentum' must be in [0, 1), got {config.momentum}")
    if config.seed < 0:
        raise ConfigError(f"config key 'seed' must be >= 0, got {config.seed}")
    if not 0.0 <= config.warmup_fraction < 1.0:
        raise ConfigError(f"config key 'warmup_fraction' must be in [0, 1), "
                          f"got {config.warmup_fraction}")
    check_compression(config)
    if not config.model.name:
        raise ConfigError("config key 'model.name' is empty; name a model, e.g. --model=bow")
    d = config.data
    for key in ("num_train", "num_test", "seq_len", "vocab_size", "block_size", "side"):
        if getattr(d, key) < 1:
            raise ConfigError(f"config key 'data.{key}' must be >= 1, got {getattr(d, key)}")
    for key in ("seed", "prefetch"):
        if getattr(d, key) < 0:
            raise ConfigError(f"config key 'data.{key}' must be >= 0, got {getattr(d, key)}")
    if config.task == "custom" and not d.path:
        raise ConfigError("task 'custom' trains on your dataset: pass --data=DIR (a directory "
                          "written by `mpidl shard`)")
    if config.task == "gpt" and not d.path:  # the generated corpus's own limits
        # Here: the corpus generator loads only for a gpt config (no engine to read one).
        from mpidl.data.language import MIN_SEQ_LEN, MIN_VOCAB

        for key, least in (("seq_len", MIN_SEQ_LEN), ("vocab_size", MIN_VOCAB)):
            if getattr(d, key) < least:
                raise ConfigError(f"config key 'data.{key}' must be >= {least} for the "
                                  f"generated language corpus, got {getattr(d, key)}")


def compression_of(config: Any) -> Any:
    """The run's parsed ``compression`` (None, a wire dtype or PowerSGD's options);
    ConfigError naming the value and the choices."""
    # Here: mpidl.parallel loads numpy, which the way to the train command's signal
    # handlers must not (tests/unit/test_imports.py).
    from mpidl.parallel.compression_choice import parse_compression

    try:
        return parse_compression(config.compression,
                                 start_powerSGD_iter=config.start_powersgd_iter,
                                 warm_start=config.powersgd_warm_start,
                                 use_error_feedback=config.powersgd_error_feedback)
    except ValueError as e:
        raise ConfigError(f"config key 'compression' (--compression): {e}") from None


def check_compression(config: Any) -> None:
    """PowerSGD where its state is checkpointed: whole-model data parallelism."""
    if config.start_powersgd_iter < 0:
        raise ConfigError(f"config key 'start_powersgd_iter' must be >= 0 (steps exchanged "
                          f"uncompressed first), got {config.start_powersgd_iter}")
    if compression_of(config) is None or isinstance(compression_of(config), str):
        return  # none, or 16 bits on the wire: every layout takes those
    split = [f"--{k.replace('_', '-')}={v}" for k, v, plain in (
        ("zero", config.zero, 0), ("tensor_parallel", config.tensor_parallel, 1),
        ("pipeline_parallel", config.pipeline_parallel, 1),
        ("sequence_parallel", config.sequence_parallel, "none")) if v != plain]
    if split:
        raise ConfigError(f"--compression={config.compression} with {', '.join(split)}: "
                          "PowerSGD compresses whole-model data parallelism's gradients "
                          "(its error feedback is checkpointed there only); use "
                          "--compression=fp16 or bf16 with ZeRO or a model split")


__all__ = ["compression_of", "validate"]
