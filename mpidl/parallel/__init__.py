"""Parallel training: data parallelism over MPI, batch norm over the global batch (later:
ZeRO, tensor and sequence parallel)."""
from mpidl.parallel.data import DataParallel
from mpidl.parallel.syncbn import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["DataParallel", "SyncBatchNorm", "convert_sync_batchnorm"]
