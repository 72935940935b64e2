"""The names of the options that several layers read, written once.

The planner (:mod:`mpidl.layouts`, which loads no engine), the configuration
(:mod:`mpidl.train.config`, which neither does: reading a config loads no engine) and
the engine (:mod:`mpidl.nn.recompute`, :mod:`mpidl.parallel.pipeline_schedule`,
:mod:`mpidl.backend`) all check these values; they import them from here, a module of
no imports, so a new mode is added in one place.
"""
from __future__ import annotations

# --precision: fp32, or half-precision parameters and activations with fp32 masters.
PRECISIONS = ("fp32", "fp16", "bf16")
# --recompute: what a transformer block keeps for backward (mpidl.nn.recompute).
RECOMPUTE = ("none", "selective", "full")
# --pipeline-schedule (mpidl.parallel.pipeline_schedule). Disjoint from the
# learning-rate schedules' names, which mpidl.train.config relies on.
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")

__all__ = ["PIPELINE_SCHEDULES", "PRECISIONS", "RECOMPUTE"]
