"""Parallel training: data parallelism over MPI, sharded data parallelism (ZeRO), batch
norm over the global batch, and tensor, sequence and pipeline parallelism on a process
grid (:mod:`mpidl.parallel.grid`, :mod:`~mpidl.parallel.tensor`,
:mod:`~mpidl.parallel.sequence`, :mod:`~mpidl.parallel.ring`, :mod:`~mpidl.parallel.gpt`,
:mod:`~mpidl.parallel.pipeline`, :mod:`~mpidl.parallel.pipeline_gpt`; docs/model-parallel.md
says when to use which).
"""
from mpidl.parallel.compression_choice import PowerSGDOptions, parse_compression
from mpidl.parallel.data import DataParallel
from mpidl.parallel.gpt import ParallelGPT, parallel_gpt
from mpidl.parallel.grid import ProcessGrid
from mpidl.parallel.pipeline import PipelineModel
from mpidl.parallel.pipeline_gpt import pipeline_gpt
from mpidl.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm
from mpidl.parallel.zero import ShardedDataParallel

__all__ = ["DataParallel", "ShardedDataParallel", "SyncBatchNorm", "convert_sync_batchnorm",
           "ProcessGrid", "ParallelGPT", "parallel_gpt", "PipelineModel", "pipeline_gpt",
           "PowerSGDOptions", "parse_compression"]
