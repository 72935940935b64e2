"""How flat buckets travel between the replicas: one interface, one class per transport.

Data parallelism allreduces gradient buckets; sharded data parallelism (ZeRO)
reduce-scatters them and allgathers parameter shards. Both ask a :class:`Transport`,
chosen once at construction by :func:`choose_transport` from the group and the options,
so neither branches on how the bytes move:

- :class:`LocalTransport`: one rank, nothing moves.
- :class:`MpiTransport`: MPI collectives on the buckets, in pieces of at most
  ``piece_bytes`` (a parameter larger than a bucket travels in bucket-sized messages,
  the size range where an allreduce is fastest).
- :class:`CompressedTransport`: gradients travel as float16 or bfloat16 and are summed
  in that format (:mod:`mpidl.parallel.compression`); parameters are never compressed.
- :class:`HierarchicalTransport`: node-local reduce, leaders' allreduce (16 bits there
  only, with compression), node-local broadcast.
- :class:`~mpidl.parallel.powersgd.PowerSGDTransport`: each gradient matrix travels as a
  rank-r approximation with error feedback (PowerSGD; its own module).
- :class:`WindowTransport`: the buckets live in an MPI-3 shared-memory window of the
  node and each rank sums its share out of the others' copies (:mod:`mpidl.comm.shared`):
  3x one MPI allreduce's throughput on one node (benchmarks/README.md).

Every method is collective over the transport's communicator, called by every rank in
the same order with buckets of the same sizes (the bucket plan is identical on every
rank). ``reduce_scatter`` and ``allgather`` work on flat arrays whose length is a
multiple of the group size (sharded data parallelism pads them so): equal blocks, rank
``r`` owning block ``r``.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy

from mpidl.backend import get_array_module
from mpidl.comm.base import CompletedRequest, Request
from mpidl.comm.hierarchical import HierarchicalCommunicator
from mpidl.comm.shared import NodeSharedArrays
from mpidl.parallel import compression as wire


class Transport:
    """The interface (and the plain-MPI defaults of the sharded operations)."""

    name = "?"

    def __init__(self, comm: Any, piece_bytes: int) -> None:
        self.comm = comm
        self.piece_bytes = piece_bytes

    # -- allreduce of gradient buckets ----------------------------------------------------
    def bind(self, flats: Sequence[Any], rows: Sequence[int | None] | None = None) -> list[Any]:
        """The arrays the buckets must live in from now on (the given ones by default).

        ``rows``: per flat, None, or its row count when it is an embedding table's
        gradient, zero outside the rows a batch touched (see :attr:`row_masks`)."""
        return list(flats)

    @property
    def row_masks(self) -> list[Any] | None:
        """Per bound flat, where this rank marks the rows it touched before
        :meth:`allreduce_all_` (None for the others), when the transport sums row-sparse
        flats itself; None when it does not (the tables then travel apart)."""
        return None

    @property
    def sums_all_at_once(self) -> bool:
        """Whether :meth:`allreduce_all_` replaces the per-bucket allreduces."""
        return False

    def allreduce_all_(self) -> bool:
        """Sum every bound bucket over the ranks at once (see :attr:`sums_all_at_once`);
        True if this rank summed some table by its marked rows alone."""
        raise NotImplementedError

    def allreduce_(self, flat: Any) -> None:
        """Blocking in-place sum of ``flat`` over the ranks."""
        _pieces(self.comm.allreduce_, flat, self.piece_bytes)

    def iallreduce_(self, flat: Any) -> Request:
        """Start an in-place sum of ``flat``; ``wait()`` on the handle leaves it summed."""
        return self.comm.iallreduce_(flat)

    # -- the sharded operations -------------------------------------------------------------
    def reduce_scatter(self, flat: Any) -> Any:
        """This rank's block of the sum of ``flat`` over the ranks (a new array)."""
        return self.comm.reduce_scatter(flat)

    def allgather(self, shard: Any, out: Any) -> Any:
        """Every rank's ``shard``, in rank order, into the flat ``out``; returns ``out``."""
        out[...] = self.comm.allgather(shard).reshape(-1)
        return out

    def close(self) -> None:
        """Release what the transport holds (collective where it holds a window)."""


class LocalTransport(Transport):
    """One rank: a sum over one rank is the value itself."""

    name = "local"

    def allreduce_(self, flat: Any) -> None:
        pass

    def iallreduce_(self, flat: Any) -> Request:
        return CompletedRequest(flat)

    def reduce_scatter(self, flat: Any) -> Any:
        return flat.copy()

    def allgather(self, shard: Any, out: Any) -> Any:
        out[...] = shard
        return out


class MpiTransport(Transport):
    """Plain MPI collectives over ``comm``."""

    name = "mpi"


class CompressedTransport(Transport):
    """Gradients travel (and are summed) as ``wire_dtype``: "float16" or "bfloat16"."""

    def __init__(self, comm: Any, piece_bytes: int, wire_dtype: str) -> None:
        super().__init__(comm, piece_bytes)
        self.wire_dtype = wire_dtype
        self.name = f"mpi, {wire_dtype} on the wire"
        self._scratch: dict[int, Any] = {}  # id(flat) -> its wire buffer, reused

    def _compress(self, flat: Any) -> Any:
        out = wire.compress(flat, self.wire_dtype, out=self._scratch.get(id(flat)))
        self._scratch[id(flat)] = out
        return out

    def allreduce_(self, flat: Any) -> None:
        packed = self._compress(flat)
        _pieces(self.comm.allreduce_, packed, self.piece_bytes,
                op=wire.wire_sum_op(self.wire_dtype))
        wire.decompress(packed, self.wire_dtype, flat)

    def iallreduce_(self, flat: Any) -> Request:
        packed = self._compress(flat)
        inner = self.comm.iallreduce_(packed, op=wire.wire_sum_op(self.wire_dtype))
        return _Then(inner, lambda: wire.decompress(packed, self.wire_dtype, flat), flat)

    def reduce_scatter(self, flat: Any) -> Any:
        packed = self._compress(flat)
        shard = self.comm.reduce_scatter(packed, op=wire.wire_sum_op(self.wire_dtype))
        out = get_array_module(flat).empty(shard.shape, dtype=flat.dtype)
        wire.decompress(shard, self.wire_dtype, out)
        return out


class HierarchicalTransport(Transport):
    """Reduce within each node, allreduce among the node leaders, broadcast in the node.

    With ``wire_dtype``, only the leaders' allreduce travels in 16 bits (the network);
    the node-local stages stay exact. The sharded operations use flat MPI.
    """

    def __init__(self, comm: Any, piece_bytes: int, ranks_per_node: int | None,
                 wire_dtype: str | None) -> None:
        super().__init__(comm, piece_bytes)
        self.reducer = HierarchicalCommunicator(comm, ranks_per_node=ranks_per_node)
        self.wire = (CompressedTransport(self.reducer.leaders, piece_bytes, wire_dtype)
                     if wire_dtype else None)
        self.name = "hierarchical" + (f", {wire_dtype} between nodes" if wire_dtype else "")

    def allreduce_(self, flat: Any) -> None:
        if self.wire is None:
            _pieces(self.reducer.allreduce_, flat, self.piece_bytes)
            return
        # One node: its sum is the result; rounding it would only lose precision.
        self.reducer.allreduce_(flat, between_nodes=lambda leaders, x: (
            self.wire.allreduce_(x) if leaders.size > 1 else None))

    def iallreduce_(self, flat: Any) -> Request:
        # Three stages chained need MPI progress between them (a progress thread);
        # later buckets of backward still overlap with this one's blocking stages.
        self.allreduce_(flat)
        return CompletedRequest(flat)

    def close(self) -> None:
        if self.reducer is not None:  # idempotent: detaching and closing both call it
            self.reducer.free()
            self.reducer = None


class WindowTransport(Transport):
    """The buckets in one node-shared window: each rank sums its share of every bucket
    out of all copies and writes the sum into every copy (two fences, no MPI message).
    The sharded operations use MPI (their arrays are not in the window)."""

    name = "node shared memory"

    def __init__(self, comm: Any, piece_bytes: int) -> None:
        super().__init__(comm, piece_bytes)
        self.window: Any = None
        self.retired: Any = None

    def bind(self, flats: Sequence[Any], rows: Sequence[int | None] | None = None) -> list[Any]:
        self.window = NodeSharedArrays(self.comm, list(flats),
                                       None if rows is None else list(rows))
        return list(self.window.local)

    @property
    def row_masks(self) -> list[Any] | None:
        return None if self.window is None else self.window.masks

    @property
    def sums_all_at_once(self) -> bool:
        return self.window is not None

    def allreduce_all_(self) -> bool:
        return self.window.allreduce_()

    def retire(self) -> None:
        """Stop summing through the window, keeping it mapped (arrays may still view it)."""
        self.retired, self.window = self.window, None

    def close(self) -> None:
        for w in (self.window, self.retired):
            if w is not None:
                w.free()
        self.window = self.retired = None


class _Then(Request):
    """A request whose completion also runs ``then()`` once (e.g. decompression)."""

    def __init__(self, inner: Request, then: Any, result: Any) -> None:
        self._inner, self._then, self._result, self._done = inner, then, result, False

    def test(self) -> bool:
        if not self._done and self._inner.test():
            self._finish()
        return self._done

    def wait(self) -> Any:
        if not self._done:
            self._inner.wait()
            self._finish()
        return self._result

    def _finish(self) -> None:
        self._done = True
        self._then()


def _pieces(allreduce_: Any, flat: Any, piece_bytes: int, op: Any = "sum") -> None:
    """Blocking in-place allreduce of a 1-D array, in messages of at most ``piece_bytes``."""
    step = max(1, piece_bytes // flat.itemsize)
    for i in range(0, flat.size, step):
        allreduce_(flat[i:i + step], op=op)


def shared_memory_excluded(comm: Any, flats: Sequence[Any], compression: str | None,
                           hierarchical: bool | int, overlap: bool) -> str:
    """Why the buckets cannot live in a node-shared window ("" when they can).

    Depends only on the group and the options (and one agreed look at /dev/shm), so
    every rank decides alike. Collective when it reaches the /dev/shm check.
    """
    if comm.size == 1 or not flats:
        return "one rank (or no dense gradients): nothing to exchange"
    if comm.local_size != comm.size or not hasattr(comm, "node_comm"):
        return "the ranks do not all share one node (an MPI communicator)"
    if not comm.node_grouping.shared_memory:  # nodes found by name (hpc.env.group_nodes)
        return f"MPI shares no memory between the node's ranks: {comm.node_grouping.reason}"
    if compression is not None or hierarchical or overlap:
        return "compression, hierarchical and overlap use MPI's allreduce"
    if get_array_module(flats[0]) is not numpy:
        return "gradients on a device (CuPy) are exchanged through MPI"
    # Open MPI backs the window with a file in /dev/shm; a full tmpfs (containers
    # default to 64 MiB) would kill the job with SIGBUS on first touch.
    need = comm.local_size * sum(f.nbytes for f in flats)
    free = _shm_free_bytes()
    short = comm.allgather_obj(free is not None and free < 2 * need)
    if any(short):
        ranks = [r for r, s in enumerate(short) if s]
        return (f"/dev/shm has {(free or 0) >> 20} MiB free on rank(s) {ranks}, the "
                f"buckets need {need >> 20} MiB twice over (Docker: --shm-size)")
    return ""


def _shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm, or None where there is none to ask."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def choose_transport(comm: Any, flats: Sequence[Any], *, piece_bytes: int,
                     compression: str | None = None, hierarchical: bool | int = False,
                     overlap: bool = False, shared_memory: bool | None = None,
                     owner: str = "DataParallel",
                     shapes: Sequence[Sequence[tuple[int, ...]]] | None = None) -> Transport:
    """The transport for these buckets and options, the same on every rank. Collective.

    ``compression``: None, a wire dtype, or
    :class:`~mpidl.parallel.compression_choice.PowerSGDOptions` (which needs ``shapes``:
    per flat, its members' shapes). ``shared_memory``: None uses the window exactly when
    it can be used, True raises if it cannot (naming why), False never uses it.
    """
    # Here: powersgd builds on this module's Transport.
    from mpidl.parallel.compression_choice import PowerSGDOptions
    from mpidl.parallel.powersgd import PowerSGDTransport

    lowrank = isinstance(compression, PowerSGDOptions)
    if lowrank and hierarchical:
        raise ValueError(f"{owner}(compression={compression}, hierarchical=...): PowerSGD "
                         "sums over one flat group; drop one of them")
    if lowrank and shapes is None:
        raise ValueError(f"{owner}(compression={compression}): PowerSGD compresses whole "
                         "gradient matrices, which only DataParallel's buckets hold; use "
                         "None, 'float16' or 'bfloat16' here")
    why_not = shared_memory_excluded(comm, flats, compression, hierarchical, overlap)
    if shared_memory and why_not:
        raise ValueError(f"{owner}(shared_memory=True): {why_not}")
    if comm.size == 1:
        return LocalTransport(comm, piece_bytes)
    if shared_memory is not False and not why_not:
        return WindowTransport(comm, piece_bytes)
    if hierarchical:
        per_node = None if hierarchical is True else int(hierarchical)
        return HierarchicalTransport(comm, piece_bytes, per_node, compression)
    if lowrank:
        return PowerSGDTransport(comm, piece_bytes, compression, shapes)
    if compression is not None:
        return CompressedTransport(comm, piece_bytes, compression)
    return MpiTransport(comm, piece_bytes)
