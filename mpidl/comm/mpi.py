"""Communicator over mpi4py: buffer-based collectives on NumPy and CuPy arrays.

Arrays go to MPI through the buffer protocol (NumPy) or ``__cuda_array_interface__``
(CuPy), never pickled. Whether a CuPy array is handed to MPI directly or staged through
pinned host memory is decided per collective by :mod:`mpidl.comm.device` (from the MPI
library and the probe of :mod:`hpc.gpu`) and carried out by :mod:`mpidl.comm.staged`.
Float16 travels as uint16 bit patterns and is summed by a user-defined op
(:mod:`mpidl.comm.datatypes`), so no collective depends on the library having a 16-bit
float type. Messages larger than ``max_message_bytes`` (2 GiB by default: MPI counts are
C ints) are split into chunks.

Every collective is numbered and remembered with its call site in the communicator's
:class:`~mpidl.comm.ledger.Ledger` (what the watchdog reports). Setting
``MPIDL_CHECK_COLLECTIVES=1`` makes every collective (barrier and ``*_obj`` included)
first compare its number, name, call site, shape, dtype and options across ranks and
raise :class:`DistributedError` on every rank at the first call where they differ,
naming what each rank called, instead of hanging, or pairing a skipped call with the
next one and corrupting a sum. It costs one small allgather per call, so it is for
debugging. The call site is compared too, so a rank-dependent branch must make one
collective call, not one per branch (``comm.bcast_obj(x if rank == 0 else None)``).
"""
from __future__ import annotations

import os
from typing import Any, Callable

from mpidl.backend import get_array_module, is_cupy, synchronize
from mpidl.comm import datatypes
from mpidl.comm.base import (MAX_TAG, Communicator, CompletedRequest, DistributedError, Request,
                             check_op, check_reducible, check_tag, split_counts)
from mpidl.comm.device import DIRECT
from mpidl.comm.ledger import Entry, Ledger
from mpidl.comm.staged import Staged, Stager

MAX_MESSAGE_BYTES = 2**31 - 1
# MPI tags of point-to-point calls: sendrecv's chunks use 0, 1, ...; a message of tag t
# goes as _DATA_TAG + t, its check-mode description as _META_TAG + t (all below the
# standard's least MPI_TAG_UB, 32767).
_DATA_TAG = MAX_TAG
_META_TAG = 2 * MAX_TAG


def _mpi():
    from mpi4py import MPI

    return MPI


def _mpi_op(op: Any):
    """An MPI op from its name; an mpi4py ``MPI.Op`` (a custom reduction) passes through."""
    if not isinstance(op, str):
        return op
    MPI = _mpi()
    return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[check_op(op)]


_next_key = 0  # the next communicator number this process has not seen in use


def _agreed_key(comm: Any) -> str:
    """A name for a new communicator that all its ranks agree on. Collective over it.

    Each rank's count of communicators made differs when ranks belong to different
    groups, so the members take the largest of their next numbers.
    """
    global _next_key
    MPI = _mpi()
    number = comm.allreduce(_next_key, op=MPI.MAX)
    _next_key = number + 1
    return "world" if number == 0 else f"comm{number}"


def _world_ranks(comm: Any) -> tuple[int, ...]:
    MPI = _mpi()
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def _described(value: Any) -> str:
    """``value`` as ranks can compare it: an object (an ``MPI.Op``) by its type, since
    its ``str`` holds a per-process address."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    return type(value).__name__


def _same_shape_contiguous(xp: Any, x: Any) -> Any:
    """``x`` C-contiguous with its own shape (``ascontiguousarray`` makes 0-d arrays 1-d)."""
    x = xp.asarray(x)
    return xp.ascontiguousarray(x).reshape(x.shape)


def _contiguous(x: Any, what: str) -> Any:
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{what} needs a C-contiguous array (got shape {x.shape}, strides {x.strides}); "
            "pass xp.ascontiguousarray(x)"
        )
    return x


class MpiRequest(Request):
    """Handle of a (possibly chunked) non-blocking collective.

    A staged device buffer's collective starts late: once its copy to the host is
    complete, and only after every collective called before it on the communicator has
    started (:class:`_StartQueue`), so that all ranks start them in the same order.
    """

    def __init__(self, requests: list | None, result: Any, finish: Callable[[], None],
                 ledger: Ledger, entry: Entry, queue: "_StartQueue | None" = None,
                 staged: Staged | None = None,
                 launch: Callable[[], list] | None = None) -> None:
        self._requests = requests  # None until started
        self._result = result
        self._finish = finish
        self._done = False
        self._ledger, self._entry = ledger, entry
        self._queue, self.staged, self._launch = queue, staged, launch

    @property
    def started(self) -> bool:
        return self._requests is not None

    def start(self) -> None:
        """Hand the operation to MPI (the :class:`_StartQueue` calls it, in order)."""
        self.staged.wait()
        self._requests = self._launch()

    def test(self) -> bool:
        if self._done:
            return True
        if not self.started:
            self._queue.run(block=False)
            if not self.started:
                return False
        if _mpi().Request.Testall(self._requests):
            self._complete()
        return self._done

    def wait(self) -> Any:
        if not self._done:
            with self._ledger.waiting(self._entry):
                if not self.started:
                    self._queue.run(until=self)
                _mpi().Request.Waitall(self._requests)
            self._complete()
        return self._result

    def _complete(self) -> None:
        self._done = True
        self._finish()


class PointToPointRequest(Request):
    """Handle of :meth:`MpiCommunicator.isend` or :meth:`MpiCommunicator.irecv_`.

    ``wait()`` marks the wait in the ledger with its peer (what the watchdog reports
    for a receive whose send never comes), then checks what arrived.
    """

    def __init__(self, comm: "MpiCommunicator", entry: Entry, requests: list,
                 finish: Callable[[], None], result: Any, meta: Any = None,
                 expect: tuple | None = None) -> None:
        self._comm, self._entry, self._requests = comm, entry, requests
        self._finish, self._result = finish, result
        self._meta, self._expect = meta, expect
        self._done = False

    def test(self) -> bool:
        if self._done:
            return True
        MPI = _mpi()
        if self._meta is not None:
            arrived, sent = self._meta.test()
            if not arrived:
                return False
            self._meta = None
            self._compare(sent)
        statuses = [MPI.Status() for _ in self._requests]
        if MPI.Request.Testall(self._requests, statuses):
            self._complete(statuses)
        return self._done

    def wait(self) -> Any:
        if self._done:
            return self._result
        MPI = _mpi()
        statuses = [MPI.Status() for _ in self._requests]
        with self._comm.ledger.waiting(self._entry):
            if self._meta is not None:
                sent, self._meta = self._meta.wait(), None
                self._compare(sent)
            try:
                MPI.Request.Waitall(self._requests, statuses)
            except MPI.Exception as e:  # a longer message than the buffer: truncated
                raise DistributedError(self._mismatch(f"more than {self._expect[2]} bytes "
                                                      f"({e.Get_error_string()})"),
                                       [self._expect[3]]) from None
        self._complete(statuses)
        return self._result

    def _complete(self, statuses: list) -> None:
        if self._expect is not None:
            got = sum(st.Get_count(_mpi().BYTE) for st in statuses)
            if got != self._expect[2]:
                raise DistributedError(self._mismatch(f"{got} bytes"), [self._expect[3]])
        self._done = True
        self._finish()

    def _compare(self, sent: tuple) -> None:
        shape, dtype, site = sent
        if (shape, dtype) != self._expect[:2]:
            raise DistributedError(self._mismatch(f"shape {shape}, {dtype} (sent at {site})"),
                                   [self._expect[3]])

    def _mismatch(self, sent: str) -> str:
        shape, dtype, nbytes, source = self._expect
        c = self._comm
        return (f"point-to-point mismatch on communicator {c.ledger.key!r}: rank {source} "
                f"(world {c.ledger.world_ranks[source]}) sent {sent}, rank {c.rank} (world "
                f"{c.ledger.world_ranks[c.rank]}) receives shape {shape}, {dtype} "
                f"({nbytes} bytes) at {self._entry.site}; a send and its receive must "
                "agree on shape and dtype (and on tag and order)")


class _StartQueue:
    """Non-blocking collectives whose staged input is still on its way to the host.

    MPI requires every rank to start the collectives of a communicator in the same
    order. Requests wait here in call order; :meth:`run` starts them from the front, so
    a later one never starts before an earlier one. The communicator runs the queue to
    the end before any other collective.
    """

    def __init__(self) -> None:
        self.items: list[MpiRequest] = []

    def run(self, block: bool = True, until: MpiRequest | None = None) -> None:
        """Start queued requests in order: all of them (``block``, waiting for their
        copies), up to and including ``until``, or (not ``block``) while their copies
        are complete."""
        while self.items:
            req = self.items[0]
            if not block and until is None and not req.staged.ready():
                return
            req.start()
            self.items.pop(0)
            if req is until:
                return


class MpiCommunicator(Communicator):
    """A group of MPI processes (over a ``Dup`` of the communicator it is given).

    Args:
        comm: an mpi4py communicator; it is duplicated, so mpidl's traffic never
            matches messages of the caller's own. Collective over ``comm``.
        cuda_aware: pass CuPy arrays straight to MPI (True), stage them through host
            memory (False), or decide by the probe of :mod:`hpc.gpu` on first use (None).
    """

    def __init__(self, comm: Any, cuda_aware: bool | None = None) -> None:
        from hpc.env import split_nodes

        self.mpi_comm = comm.Dup()
        self.rank = self.mpi_comm.Get_rank()
        self.size = self.mpi_comm.Get_size()
        # The node-local group is found now, while every rank is in this collective
        # constructor: a lazy split would be collective behind an attribute read. MPI's
        # shared-memory split, unless it disagrees with the node names (hpc.env).
        self.node_comm, self.node_grouping = split_nodes(self.mpi_comm)
        self.local_rank = self.node_comm.Get_rank()
        self.local_size = self.node_comm.Get_size()
        self.max_message_bytes = MAX_MESSAGE_BYTES
        self.check_collectives = os.environ.get("MPIDL_CHECK_COLLECTIVES", "0") not in ("", "0")
        self.ledger = Ledger(_agreed_key(self.mpi_comm), _world_ranks(self.mpi_comm))
        self.stager = Stager(self, cuda_aware)  # how device buffers reach MPI
        self._unstarted = _StartQueue()

    # -- helpers ----------------------------------------------------------------------
    def _chunks(self, n: int, itemsize: int) -> list[tuple[int, int]]:
        """Element ranges of at most ``max_message_bytes`` covering ``range(n)``."""
        step = max(1, self.max_message_bytes // itemsize)
        return [(i, min(i + step, n)) for i in range(0, n, step)] or [(0, 0)]

    def _begin(self, name: str, x: Any = None, queued: bool = False, **extra: Any) -> Entry:
        """Number the collective ``name`` in the ledger; in check mode, first agree with
        every rank that it is the same call (see the module docstring).

        Non-blocking collectives still waiting for their staged input start first, so
        that every rank starts the communicator's collectives in call order; ``queued``
        (a staged non-blocking one, which joins the end of that queue) skips this,
        except in check mode, whose agreement is itself a collective.
        """
        if not queued or self.check_collectives:
            self._unstarted.run()
        entry = self.ledger.begin(name)
        if self.check_collectives:
            params = tuple(sorted((k, _described(v)) for k, v in extra.items()))
            shape = None if x is None else (tuple(x.shape), str(x.dtype))
            mine = (entry.seq, name, entry.site, shape, params)
            with self.ledger.waiting(entry):
                everyone = self.mpi_comm.allgather(mine)  # raw: not itself a numbered call
            if any(other != everyone[0] for other in everyone):
                raise DistributedError(_mismatch(self.ledger.key, everyone),
                                       [r for r, o in enumerate(everyone) if o != everyone[0]],
                                       group_size=self.size)
        return entry

    def _device(self, x: Any, mode: str, collective: str,
                op: Any = None) -> tuple[Any, Callable[[], None]]:
        """The buffer to hand MPI for ``x`` in ``collective`` and a function to call when
        MPI is done: ``x`` itself, or a host copy where :mod:`mpidl.comm.device` says so.

        ``mode`` is "in" (send buffer), "out" (receive buffer) or "inout" (in place).
        """
        if is_cupy(get_array_module(x)):
            return self.stager.stage(x, mode, collective, op)
        return x, _nothing

    # -- collectives ------------------------------------------------------------------
    def allreduce_(self, x: Any, op: str = "sum") -> Any:
        """Reduce ``x`` elementwise over all ranks, in place; returns ``x``.

        Collective: every rank passes a C-contiguous array of the same shape and dtype
        and the same ``op`` ("sum", "max", "min", "prod", or an mpi4py ``MPI.Op`` for a
        custom reduction such as the 16-bit float sums of gradient compression).
        """
        MPI = _mpi()
        _contiguous(x, "allreduce_")
        check_reducible(x, "allreduce_", op)
        entry = self._begin("allreduce_", x, op=op)
        wire, op = datatypes.reducible(x, op, "allreduce_")
        buf, finish = self._device(wire, "inout", "allreduce_", op)
        flat = buf.reshape(-1)
        mop = _mpi_op(op)
        with self.ledger.waiting(entry):
            for i, j in self._chunks(flat.size, flat.itemsize):
                self.mpi_comm.Allreduce(MPI.IN_PLACE, flat[i:j], op=mop)
        finish()
        return x

    def iallreduce_(self, x: Any, op: str = "sum") -> MpiRequest:
        """Start an in-place allreduce of ``x``; returns a handle with ``test``/``wait``.

        Collective: as :meth:`allreduce_`; every rank must ``wait()`` (or ``test()``
        until True) and must not touch ``x`` before then. Open MPI progresses the
        operation only inside MPI calls, so calling ``test()`` between compute steps is
        what makes it overlap.

        A device buffer is staged (:mod:`mpidl.comm.device`) without blocking the host:
        its copy to pinned memory runs on a side stream, and the MPI operation starts
        once that copy is complete, seen by a later ``test()``, ``wait()`` or collective.
        """
        MPI = _mpi()
        _contiguous(x, "iallreduce_")
        check_reducible(x, "iallreduce_", op)
        wire, wop = datatypes.reducible(x, op, "iallreduce_")
        staged = is_cupy(get_array_module(wire)) and \
            self.stager.path("iallreduce_", wop) != DIRECT
        entry = self._begin("iallreduce_", x, queued=staged, op=op)
        op, mop = wop, _mpi_op(wop)

        def launch(buf: Any) -> list:
            flat = buf.reshape(-1)
            return [self.mpi_comm.Iallreduce(MPI.IN_PLACE, flat[i:j], op=mop)
                    for i, j in self._chunks(flat.size, flat.itemsize)]

        if staged:
            copy = self.stager.stage_nonblocking(wire)
            req = MpiRequest(None, x, copy.release, self.ledger, entry, self._unstarted,
                             copy, lambda: launch(copy.host))
            self._unstarted.items.append(req)
            self._unstarted.run(block=False)  # at once if the copy is already done
            return req
        buf, finish = self._device(wire, "inout", "iallreduce_", op)
        return MpiRequest(launch(buf), x, finish, self.ledger, entry)

    def reduce_(self, x: Any, root: int = 0, op: Any = "sum") -> Any:
        """Reduce ``x`` over all ranks into root's ``x``, in place; returns ``x``.

        Collective: same shape, dtype, ``root`` and ``op`` everywhere. Only root's ``x``
        holds the result; the other ranks' ``x`` are left as they were.
        """
        MPI = _mpi()
        _contiguous(x, "reduce_")
        check_reducible(x, "reduce_", op)
        entry = self._begin("reduce_", x, root=root, op=op)
        wire, op = datatypes.reducible(x, op, "reduce_")
        buf, finish = self._device(wire, "inout", "reduce_", op)
        flat = buf.reshape(-1)
        mop = _mpi_op(op)
        with self.ledger.waiting(entry):
            for i, j in self._chunks(flat.size, flat.itemsize):
                if self.rank == root:
                    self.mpi_comm.Reduce(MPI.IN_PLACE, flat[i:j], op=mop, root=root)
                else:
                    self.mpi_comm.Reduce(flat[i:j], None, op=mop, root=root)
        finish()
        return x

    def bcast_(self, x: Any, root: int = 0) -> Any:
        """Overwrite ``x`` on every rank with root's ``x``, in place; returns ``x``.

        Collective: same shape and dtype everywhere, same ``root``.
        """
        _contiguous(x, "bcast_")
        entry = self._begin("bcast_", x, root=root)
        # Root's buffer is only read and the others' only written: a staged copy goes
        # one way on each rank.
        buf, finish = self._device(datatypes.bits(x), "in" if self.rank == root else "out",
                                   "bcast_")
        flat = buf.reshape(-1)
        with self.ledger.waiting(entry):
            for i, j in self._chunks(flat.size, flat.itemsize):
                self.mpi_comm.Bcast(flat[i:j], root=root)
        finish()
        return x

    def allgather(self, x: Any) -> Any:
        """Return every rank's ``x`` stacked: shape ``(size, *x.shape)``, row r from rank r.

        Collective: same shape and dtype on every rank.
        """
        xp = get_array_module(x)
        x = _same_shape_contiguous(xp, x)
        entry = self._begin("allgather", x)
        out = xp.empty((self.size,) + x.shape, dtype=x.dtype)
        src, release = self._device(datatypes.bits(x), "in", "allgather")
        dst, finish = self._device(datatypes.bits(out), "out", "allgather")
        flat_src = src.reshape(-1)
        flat_dst = dst.reshape(self.size, -1)
        chunks = self._chunks(flat_src.size, flat_src.itemsize * self.size)
        with self.ledger.waiting(entry):
            if len(chunks) == 1:
                self.mpi_comm.Allgather(flat_src, flat_dst)
            else:
                bxp = get_array_module(src)  # numpy when the device array was staged
                for i, j in chunks:
                    part = bxp.empty((self.size, j - i), dtype=src.dtype)
                    piece = bxp.ascontiguousarray(flat_src[i:j])
                    synchronize(piece)  # device buffers: the copies must be done for MPI
                    self.mpi_comm.Allgather(piece, part)
                    flat_dst[:, i:j] = part
        finish()
        release()
        return out

    def iallgather(self, x: Any) -> Any:
        """Start :meth:`allgather`; ``wait()`` on the handle returns the ``(size, *shape)``
        result. Collective as allgather; ``x`` must not be written until then (sharded
        data parallelism gathers the next unit's parameters while this one computes).
        """
        xp = get_array_module(x)
        x = _same_shape_contiguous(xp, x)
        out = xp.empty((self.size,) + x.shape, dtype=x.dtype)
        if out.nbytes > self.max_message_bytes:  # beyond one message: the blocking path
            return CompletedRequest(self.allgather(x))
        entry = self._begin("iallgather", x)
        src, release = self._device(datatypes.bits(x), "in", "iallgather")
        dst, finish = self._device(datatypes.bits(out), "out", "iallgather")

        def done() -> None:
            finish()
            release()

        req = self.mpi_comm.Iallgather(src.reshape(-1), dst.reshape(self.size, -1))
        return MpiRequest([req], out, done, self.ledger, entry)

    def allgatherv(self, x: Any) -> Any:
        """Concatenate every rank's ``x`` along axis 0, in rank order.

        Collective: ``x.shape[1:]`` and dtype must match on every rank; ``x.shape[0]``
        may differ (zero included).
        """
        xp = get_array_module(x)
        x = xp.ascontiguousarray(x)
        self._begin("allgatherv")  # numbered; the allgather below checks the shapes
        # One small allgather carries both the agreement check and the row counts.
        meta = self.allgather_obj((tuple(x.shape[1:]), str(x.dtype), int(x.shape[0])))
        shapes = [m[:2] for m in meta]
        bad = [r for r, s in enumerate(shapes) if s != shapes[0]]
        if bad:  # every rank sees the same list, so every rank raises here together
            self.check(self.rank not in bad, f"allgatherv: trailing shape/dtype "
                                             f"{shapes[self.rank]} differs from rank 0's "
                                             f"{shapes[0]}")
        rows = [m[2] for m in meta]
        row_items = 1
        for d in x.shape[1:]:
            row_items *= d
        out = xp.empty((sum(rows),) + x.shape[1:], dtype=x.dtype)
        total_bytes = sum(rows) * row_items * x.itemsize
        if total_bytes <= self.max_message_bytes:
            counts = [n * row_items for n in rows]
            displs = [sum(counts[:r]) for r in range(self.size)]
            src, release = self._device(datatypes.bits(x), "in", "allgatherv")
            dst, finish = self._device(datatypes.bits(out), "out", "allgatherv")
            self.mpi_comm.Allgatherv(src.reshape(-1), [dst.reshape(-1), (counts, displs)])
            finish()
            release()
        else:  # beyond one message: broadcast each rank's block in chunks
            start = 0
            for r, n in enumerate(rows):
                block = out[start:start + n]
                if r == self.rank:
                    block[...] = x
                self.bcast_(block, root=r)
                start += n
        return out

    def reduce_scatter(self, x: Any, op: str = "sum") -> Any:
        """Reduce ``x`` over all ranks and return this rank's block of the result.

        ``x`` is split along axis 0 into ``size`` blocks as evenly as possible (the first
        ``x.shape[0] % size`` blocks get one more row); rank r receives block r.
        Collective: same shape and dtype on every rank, same ``op``. Equal blocks go
        through ``MPI_Reduce_scatter_block`` (which CUDA-aware Open MPI handles on device
        buffers), uneven ones through ``MPI_Reduce_scatter``.
        """
        xp = get_array_module(x)
        x = xp.ascontiguousarray(x)
        check_reducible(x, "reduce_scatter", op)
        entry = self._begin("reduce_scatter", x, op=op)
        rows = split_counts(x.shape[0], self.size)
        start = sum(rows[: self.rank])
        if x.nbytes > self.max_message_bytes:  # rare: reduce in chunks, then keep our rows
            full = self.allreduce_(x.copy(), op)
            return full[start:start + rows[self.rank]].copy()
        row_items = x.size // x.shape[0] if x.shape[0] else 0
        out = xp.empty((rows[self.rank],) + x.shape[1:], dtype=x.dtype)
        equal = len(set(rows)) == 1  # the same on every rank: the shapes agree
        name = "reduce_scatter_block" if equal else "reduce_scatter"
        wire, mop = datatypes.reducible(x, op, "reduce_scatter")
        src, release = self._device(wire, "in", name, mop)
        dst, finish = self._device(datatypes.bits(out), "out", name, mop)
        with self.ledger.waiting(entry):
            if equal:
                self.mpi_comm.Reduce_scatter_block(src.reshape(-1), dst.reshape(-1),
                                                   op=_mpi_op(mop))
            else:
                self.mpi_comm.Reduce_scatter(src.reshape(-1), dst.reshape(-1),
                                             [n * row_items for n in rows], op=_mpi_op(mop))
        finish()
        release()
        return out

    def alltoall(self, x: Any) -> Any:
        """Exchange blocks: block j of ``x`` (``x[j]``) goes to rank j.

        Returns ``y`` with ``y[i]`` = block ``rank`` of rank i's ``x``. Collective:
        ``x.shape[0] == size`` and the same shape and dtype on every rank.
        """
        xp = get_array_module(x)
        if x.shape[:1] != (self.size,):
            raise ValueError(f"alltoall needs x.shape[0] == size == {self.size}, "
                             f"got shape {x.shape}")
        x = xp.ascontiguousarray(x)
        entry = self._begin("alltoall", x)
        out = xp.empty_like(x)
        src, release = self._device(datatypes.bits(x), "in", "alltoall")
        dst, finish = self._device(datatypes.bits(out), "out", "alltoall")
        s2, d2 = src.reshape(self.size, -1), dst.reshape(self.size, -1)
        chunks = self._chunks(s2.shape[1], s2.itemsize * self.size)
        with self.ledger.waiting(entry):
            if len(chunks) == 1:
                self.mpi_comm.Alltoall(s2, d2)
            else:
                bxp = get_array_module(src)  # numpy when the device array was staged
                for i, j in chunks:
                    part = bxp.empty((self.size, j - i), dtype=src.dtype)
                    piece = bxp.ascontiguousarray(s2[:, i:j])
                    synchronize(piece)  # device buffers: the copies must be done for MPI
                    self.mpi_comm.Alltoall(piece, part)
                    d2[:, i:j] = part
        finish()
        release()
        return out

    def sendrecv(self, x: Any, dest: int, source: int) -> Any:
        """Send ``x`` to ``dest`` and return the array received from ``source``.

        Point-to-point in pairs: rank ``source`` must send to this rank in the same call,
        with the same shape and dtype (a ring shift is the usual use).
        """
        out, fs, fd, done = self._pair_buffers(x, "sendrecv")
        # Point-to-point, so not compared across ranks in check mode; numbered for the
        # watchdog's report.
        with self.ledger.waiting(self.ledger.begin("sendrecv")):
            for tag, (i, j) in enumerate(self._chunks(fs.size, fs.itemsize)):
                self.mpi_comm.Sendrecv(fs[i:j], dest=dest, sendtag=tag,
                                       recvbuf=fd[i:j], source=source, recvtag=tag)
        done()
        return out

    def isendrecv(self, x: Any, dest: int, source: int) -> MpiRequest:
        """Start sending ``x`` to ``dest`` and receiving an array like it from ``source``.

        Returns a handle whose ``wait()`` returns the received array. Point-to-point in
        pairs, as :meth:`sendrecv`; ``x`` may be read but not written until then (ring
        attention computes on the block it is passing on). Several exchanges in flight
        between the same ranks match in the order they were started (MPI's
        non-overtaking rule), so every rank must start them in the same order.
        """
        out, fs, fd, done = self._pair_buffers(x, "isendrecv")
        entry = self.ledger.begin("isendrecv")  # point-to-point: not compared in check mode
        reqs = []
        for tag, (i, j) in enumerate(self._chunks(fs.size, fs.itemsize)):
            reqs.append(self.mpi_comm.Irecv(fd[i:j], source=source, tag=tag))
            reqs.append(self.mpi_comm.Isend(fs[i:j], dest=dest, tag=tag))
        return MpiRequest(reqs, out, done, self.ledger, entry)

    def _pair_buffers(self, x: Any, collective: str
                      ) -> tuple[Any, Any, Any, Callable[[], None]]:
        """For a send of ``x`` and a receive like it: the result array, the flat send
        and receive buffers to hand MPI, and what to call when MPI is done."""
        xp = get_array_module(x)
        x = _same_shape_contiguous(xp, x)
        out = xp.empty_like(x)
        src, release = self._device(datatypes.bits(x), "in", collective)
        dst, finish = self._device(datatypes.bits(out), "out", collective)

        def done() -> None:
            finish()
            release()

        return out, src.reshape(-1), dst.reshape(-1), done

    # -- point to point ------------------------------------------------------------
    def isend(self, x: Any, dest: int, tag: int = 0) -> "PointToPointRequest":
        """Start sending ``x`` to ``dest`` (see :meth:`Communicator.isend`).

        Point-to-point; ``x`` must not be written until ``wait()``. Numbered in the
        ledger apart from the collectives, with the peer, for the watchdog. Under
        ``MPIDL_CHECK_COLLECTIVES=1`` a small pickled description (shape, dtype, call
        site) goes first, for the receiver to compare.
        """
        xp = get_array_module(x)
        x = _same_shape_contiguous(xp, x)
        self._check_peer(dest, "dest", "isend")
        entry = self.ledger.begin("isend", peer=self.ledger.world_ranks[dest])
        tag = check_tag(tag)
        src, release = self._p2p_device(x, "in", "isend")
        reqs = []
        if self.check_collectives:
            reqs.append(self.mpi_comm.isend((tuple(x.shape), str(x.dtype), entry.site),
                                            dest=dest, tag=_META_TAG + tag))
        flat = src.reshape(-1)
        reqs += [self.mpi_comm.Isend(flat[i:j], dest=dest, tag=_DATA_TAG + tag)
                 for i, j in self._chunks(flat.size, flat.itemsize)]
        return PointToPointRequest(self, entry, reqs, release, None)

    def irecv_(self, x: Any, source: int, tag: int = 0) -> "PointToPointRequest":
        """Start receiving from ``source`` into ``x`` (see :meth:`Communicator.irecv_`).

        Point-to-point; ``x`` is filled at ``wait()``. A message of another byte size
        is a :class:`DistributedError` naming both ranks (MPI reports a longer one as
        truncated, and fills a shorter one silently, so the count is compared); under
        ``MPIDL_CHECK_COLLECTIVES=1`` so is another shape or dtype.
        """
        _contiguous(x, "irecv_")
        self._check_peer(source, "source", "irecv_")
        entry = self.ledger.begin("irecv_", peer=self.ledger.world_ranks[source])
        tag = check_tag(tag)
        dst, finish = self._p2p_device(x, "out", "irecv_")
        meta = None
        if self.check_collectives:
            meta = self.mpi_comm.irecv(source=source, tag=_META_TAG + tag)
        flat = dst.reshape(-1)
        reqs = [self.mpi_comm.Irecv(flat[i:j], source=source, tag=_DATA_TAG + tag)
                for i, j in self._chunks(flat.size, flat.itemsize)]
        expect = (tuple(x.shape), str(x.dtype), int(flat.nbytes), source)
        return PointToPointRequest(self, entry, reqs, finish, x, meta, expect)

    def prepare_device(self) -> None:
        """Decide now how device arrays reach MPI in point-to-point calls. Collective.

        The decision (:mod:`mpidl.comm.device`) probes MPI over the whole group the
        first time; a point-to-point call, made by two ranks only, cannot, so code that
        sends device arrays calls this once, on every rank, first.
        """
        self.stager.path("isend")

    def _p2p_device(self, x: Any, mode: str, name: str) -> tuple[Any, Callable[[], None]]:
        if is_cupy(get_array_module(x)) and self.stager.cuda_aware is None:
            raise RuntimeError(
                f"{name} of a device array on {self!r} before the communicator decided "
                "how device arrays reach MPI (a collective probe): call "
                "comm.prepare_device() on every rank of it first")
        return self._device(datatypes.bits(x), mode, name)

    def _check_peer(self, peer: int, what: str, name: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.size:
            raise ValueError(f"{name}: {what}={peer!r} is not a rank of this size-{self.size} "
                             "communicator")

    def barrier(self) -> None:
        """Wait until every rank has called barrier. Collective."""
        with self.ledger.waiting(self._begin("barrier")):
            self.mpi_comm.Barrier()

    def allgather_obj(self, obj: Any) -> list:
        """Return the list of every rank's ``obj`` (pickled; for small metadata only).

        Collective; the objects may differ between ranks.
        """
        with self.ledger.waiting(self._begin("allgather_obj")):
            return self.mpi_comm.allgather(obj)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Return root's ``obj`` on every rank (pickled; for small metadata only).

        Collective; non-root ranks may pass anything (None).
        """
        with self.ledger.waiting(self._begin("bcast_obj", root=root)):
            return self.mpi_comm.bcast(obj, root=root)

    def split(self, color: int, key: int | None = None) -> "MpiCommunicator":
        """Ranks passing the same ``color`` form a new communicator.

        Collective over this group. Ranks in the new group are ordered by ``key``
        (default: the rank here). Returns a new :class:`MpiCommunicator`.
        """
        with self.ledger.waiting(self._begin("split")):
            part = self.mpi_comm.Split(color, self.rank if key is None else key)
        try:
            return MpiCommunicator(part, cuda_aware=self.stager.cuda_aware)
        finally:
            part.Free()

    def free(self) -> None:
        """Free the duplicated MPI communicators. Collective."""
        if self.mpi_comm is not None:
            self._unstarted.run()  # a freed communicator cannot start them any more
        for c in (self.node_comm, self.mpi_comm):
            if c is not None and not _mpi().Is_finalized():
                c.Free()
        self.node_comm = self.mpi_comm = None


def _nothing() -> None:
    pass


def _mismatch(key: str, everyone: list) -> str:
    """The check-mode error: what each group of ranks called at the first divergent call."""
    groups: dict = {}
    for rank, call in enumerate(everyone):
        groups.setdefault(call, []).append(rank)
    lines = []
    for (seq, name, site, shape, params), ranks in groups.items():
        args = [] if shape is None else [f"shape {shape[0]}, {shape[1]}"]
        args += [f"{k}={v}" for k, v in params]
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        lines.append(f"  {who}: #{seq} {name}({', '.join(args)}) at {site}")
    return (f"collective mismatch on communicator {key!r} (MPIDL_CHECK_COLLECTIVES=1): the "
            "ranks' calls differ at the first divergent collective; every rank must make "
            "the same collective calls in the same order, from the same place:\n"
            + "\n".join(lines))


__all__ = ["MpiCommunicator", "MpiRequest", "PointToPointRequest", "MAX_MESSAGE_BYTES"]
