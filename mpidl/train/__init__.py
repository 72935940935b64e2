"""Training: configuration, checkpoints, metrics, timeline, progress, preemption.

``mpidl train`` (:mod:`mpidl.train.command`) puts these together; each piece is usable
on its own. Importing this package does not import mpi4py, h5py or matplotlib.
"""
from mpidl.train.checkpoint import (
    Checkpoint,
    CheckpointError,
    keep_last,
    latest_checkpoint,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from mpidl.train.config import Config, ConfigError, list_presets, load_config, to_toml
from mpidl.train.log import Logger, ProgressBar, format_summary, format_table
from mpidl.train.metrics import MetricsWriter, StepTimer, Throughput, read_metrics
from mpidl.train.signals import EXIT_PREEMPTED, PreemptionFlag
from mpidl.train.timeline import Timeline

__all__ = [
    "Config", "ConfigError", "load_config", "to_toml", "list_presets",
    "Checkpoint", "CheckpointError", "save_checkpoint", "load_checkpoint",
    "latest_checkpoint", "keep_last", "resolve_resume",
    "MetricsWriter", "StepTimer", "Throughput", "read_metrics",
    "Timeline", "Logger", "ProgressBar", "format_table", "format_summary",
    "PreemptionFlag", "EXIT_PREEMPTED",
]
