"""Ranks agree before they can diverge: the same options and the same model everywhere.

A wrapper's options decide which collectives run (and how many, in what order), and
its parameter list decides the buckets; ranks that differ in either would wait for each
other forever or sum mismatched arrays. Both checks are collective and raise
:class:`~mpidl.comm.DistributedError` on every rank, naming the ranks and values that
differ. :class:`~mpidl.parallel.DataParallel` and
:class:`~mpidl.parallel.ShardedDataParallel` both run them first.
"""
from __future__ import annotations

from typing import Any, Sequence

from mpidl.parallel.syncbn import SyncBatchNorm


def check_same_options(comm: Any, owner: str, **options: Any) -> None:
    """Raise DistributedError on every rank unless all ranks passed the same options."""
    everyone = comm.allgather_obj(sorted(options.items()))
    # True == 1 in Python, but hierarchical=True (the real nodes) and hierarchical=1
    # (one rank per node) differ; 4 and 4.0 MiB do not.
    differing = sorted({name for theirs in everyone
                        for (name, value), (_, ref) in zip(theirs, everyone[0])
                        if (isinstance(value, bool), value) != (isinstance(ref, bool), ref)})
    detail = "; ".join(f"{name}: " + ", ".join(
        f"rank {r} {dict(theirs)[name]!r}" for r, theirs in enumerate(everyone))
        for name in differing)
    comm.check(not differing, f"{owner} options differ between ranks: {detail}. Pass the "
                              "same options on every rank.")


def check_same_parameters(comm: Any, named: Sequence[tuple[str, Any]]) -> None:
    """Raise DistributedError on every rank unless all ranks built the same parameters
    (names, shapes, dtypes, in order)."""
    mine = [(n, tuple(p.data.shape), str(p.data.dtype)) for n, p in named]
    everyone = comm.allgather_obj(mine)
    reference = everyone[0]
    problems = []
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for k, (a, b) in enumerate(zip(theirs, reference)):
            if a != b:
                problems.append(
                    f"parameter #{k}: rank {r} has {a[0]!r} shape {a[1]} {a[2]}, "
                    f"rank 0 has {b[0]!r} shape {b[1]} {b[2]}")
                break
        else:
            problems.append(
                f"rank {r} has {len(theirs)} parameters, rank 0 has {len(reference)}")
    bad = comm.rank != 0 and everyone[comm.rank] != reference
    detail = "; ".join(problems)
    comm.check(not bad, "the model differs between ranks: " + detail +
               ". Build the same model (same code, sizes and dtype) on every rank.")


def drifting_buffers(model: Any) -> list:
    """The model's buffers that replicas would let drift apart: batch norm's running
    statistics, which each rank updates from its own share of the batch.

    Not those kept identical by synced batch norm, nor those that never change in
    training (a Standardize's scale, ``constant_buffers``): broadcasting those would
    cost collectives for nothing. Data parallel wrappers broadcast rank 0's drifting
    buffers before every training forward, as PyTorch DDP does. Not collective.
    """
    kept = {id(b) for _, m in model.named_modules()
            if isinstance(m, SyncBatchNorm) or getattr(m, "constant_buffers", False)
            for b in m.buffers()}
    return [b for b in model.buffers() if id(b) not in kept]
