"""Parallel training: data parallelism over MPI (later: ZeRO, tensor and sequence parallel)."""
from mpidl.parallel.data import DataParallel

__all__ = ["DataParallel"]
