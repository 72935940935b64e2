"""Training: configuration, checkpoints, metrics, timeline, progress, preemption.

``mpidl train`` (:mod:`mpidl.train.command`) puts these together; each piece is usable
on its own. Importing this package does not import mpi4py, h5py or matplotlib, nor
NumPy: its names are imported on first use (PEP 562), so that ``mpidl train`` can
install its signal handlers before any heavy import (see :mod:`mpidl`).
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "mpidl.train.checkpoint": ["Checkpoint", "CheckpointError", "latest_checkpoint",
                               "load_checkpoint", "resolve_resume", "save_checkpoint"],
    "mpidl.train.retention": ["keep_last"],
    "mpidl.train.config": ["Config", "ConfigError", "list_presets", "load_config", "to_toml"],
    "mpidl.train.log": ["Logger", "ProgressBar", "format_summary", "format_table"],
    "mpidl.train.metrics": ["MetricsWriter", "StepTimer", "Throughput", "read_metrics"],
    "mpidl.train.signals": ["EXIT_PREEMPTED", "PreemptionFlag", "Preempted"],
    "mpidl.train.timeline": ["Timeline"],
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [
    "Config", "ConfigError", "load_config", "to_toml", "list_presets",
    "Checkpoint", "CheckpointError", "save_checkpoint", "load_checkpoint",
    "latest_checkpoint", "keep_last", "resolve_resume",
    "MetricsWriter", "StepTimer", "Throughput", "read_metrics",
    "Timeline", "Logger", "ProgressBar", "format_table", "format_summary",
    "PreemptionFlag", "Preempted", "EXIT_PREEMPTED",
]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'mpidl.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
