<<<<<<< HEAD
"""Parallel training: data parallelism over MPI, and tensor and sequence parallelism on a
process grid (:mod:`mpidl.parallel.grid`, :mod:`~mpidl.parallel.tensor`,
:mod:`~mpidl.parallel.sequence`, :mod:`~mpidl.parallel.ring`, :mod:`~mpidl.parallel.gpt`;
docs/model-parallel.md says when to use which).
"""
from mpidl.parallel.data import DataParallel
from mpidl.parallel.gpt import ParallelGPT, parallel_gpt
from mpidl.parallel.grid import ProcessGrid
from mpidl.parallel.zero import ShardedDataParallel

__all__ = ["DataParallel", "ShardedDataParallel", "ProcessGrid", "ParallelGPT", "parallel_gpt"]
=======
"""Parallel training: data parallelism over MPI, batch norm over the global batch (later:
ZeRO, tensor and sequence parallel)."""
from mpidl.parallel.data import DataParallel
from mpidl.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["DataParallel", "SyncBatchNorm", "convert_sync_batchnorm"]
>>>>>>> sci19
