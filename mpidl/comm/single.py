"""A world of one rank: every collective is the identity (or a copy).

Used when mpi4py is absent or the process was not started by an MPI launcher, so a
script runs unchanged as ``python train.py``.
"""
from __future__ import annotations

import collections
import copy
from typing import Any

from mpidl.comm.base import (Communicator, CompletedRequest, DistributedError, Request, check_op,
                             check_reducible, check_tag)


class SingleCommunicator(Communicator):
    """The size-1 group ``{0}``; methods keep the contract of :class:`Communicator`."""

    rank = 0
    size = 1
    local_rank = 0
    local_size = 1
    mpi_comm = None

    def allreduce_(self, x: Any, op: str = "sum") -> Any:
        """In place: the reduction over one rank leaves ``x`` unchanged."""
        check_op(op)
        check_reducible(x, "allreduce_", op)
        return x

    def reduce_(self, x: Any, root: int = 0, op: str = "sum") -> Any:
        """In place: root's reduction over one rank is ``x``."""
        check_op(op)
        check_reducible(x, "reduce_", op)
        self._check_peer(root, "root")
        return x

    def bcast_(self, x: Any, root: int = 0) -> Any:
        """In place: ``x`` is root's value already."""
        self._check_peer(root, "root")
        return x

    def allgather(self, x: Any) -> Any:
        """Return ``x`` stacked once, shape ``(1, *x.shape)``."""
        return x[None].copy()

    def allgatherv(self, x: Any) -> Any:
        """Return a copy of ``x`` (the concatenation of one block)."""
        return x.copy()

    def reduce_scatter(self, x: Any, op: str = "sum") -> Any:
        """Return a copy of ``x``: one rank receives the whole (reduced) array."""
        check_op(op)
        check_reducible(x, "reduce_scatter", op)
        return x.copy()

    def alltoall(self, x: Any) -> Any:
        """Return a copy of ``x`` (shape ``(1, ...)``): block 0 goes to rank 0."""
        if x.shape[:1] != (1,):
            raise ValueError(f"alltoall needs x.shape[0] == size == 1, got shape {x.shape}")
        return x.copy()

    def sendrecv(self, x: Any, dest: int, source: int) -> Any:
        """Send to and receive from rank 0 itself: returns a copy of ``x``."""
        self._check_peer(dest, "dest")
        self._check_peer(source, "source")
        return x.copy()

    def isendrecv(self, x: Any, dest: int, source: int) -> Request:
        """Non-blocking :meth:`sendrecv` with rank 0 itself; complete at once (a copy)."""
        return CompletedRequest(self.sendrecv(x, dest, source))

    def isend(self, x: Any, dest: int, tag: int = 0) -> Request:
        """Send a copy of ``x`` to rank 0 itself; complete at once (received later by
        :meth:`irecv_` with the same tag, in order)."""
        self._check_peer(dest, "dest")
        self._mail(check_tag(tag)).append(x.copy())
        return CompletedRequest(None)

    def irecv_(self, x: Any, source: int, tag: int = 0) -> Request:
        """Receive into ``x`` the oldest message this rank sent itself with ``tag``."""
        self._check_peer(source, "source")
        box = self._mail(check_tag(tag))
        if not box:
            raise DistributedError(f"irecv_(tag={tag}) on a size-1 communicator with no "
                                   "message of that tag sent: it would wait for ever", [0])
        got = box.popleft()
        if got.shape != x.shape or got.dtype != x.dtype:
            raise DistributedError(f"point-to-point mismatch: rank 0 sent shape {got.shape}, "
                                   f"{got.dtype}, rank 0 receives shape {x.shape}, {x.dtype}",
                                   [0])
        x[...] = got
        return CompletedRequest(x)

    def _mail(self, tag: int) -> collections.deque:
        if "_boxes" not in self.__dict__:
            self._boxes: dict[int, collections.deque] = {}
        return self._boxes.setdefault(tag, collections.deque())

    def iallgather(self, x: Any) -> Request:
        """Non-blocking :meth:`allgather`; complete at once."""
        return CompletedRequest(self.allgather(x))

    def iallreduce_(self, x: Any, op: str = "sum") -> Request:
        """Non-blocking in-place reduction; already complete on one rank."""
        check_op(op)
        check_reducible(x, "iallreduce_", op)
        return CompletedRequest(x)

    def barrier(self) -> None:
        """Nothing to wait for."""

    def allgather_obj(self, obj: Any) -> list:
        """Return ``[obj]`` (a deep copy, as a pickled round trip would give)."""
        return [copy.deepcopy(obj)]

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Return ``obj`` (a deep copy)."""
        self._check_peer(root, "root")
        return copy.deepcopy(obj)

    def split(self, color: int, key: int | None = None) -> "SingleCommunicator":
        """Return a new size-1 communicator."""
        return SingleCommunicator()

    def _check_peer(self, peer: int, what: str) -> None:
        if peer != 0:
            raise ValueError(f"{what}={peer} is not a rank of a size-1 communicator")
