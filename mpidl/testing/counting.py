"""A communicator that counts what passes through it: calls and bytes per operation.

For tests and benchmarks that compare communication with theory (the bytes a tensor-
or sequence-parallel layer sends): wrap the world before building the grid, and every
axis communicator split from it counts too::

    world = CountingCommunicator(mpidl.comm.world())
    grid = ProcessGrid(world, tensor=2)
    ... forward and backward ...
    grid.tensor.counts["allreduce_"]  # Count(calls=4, nbytes=...)

What is counted is the array each call hands over: the buffer reduced by
``allreduce_`` and ``reduce_scatter``, this rank's contribution to ``allgather(v)``,
the whole buffer of ``alltoall`` (its own block included) and the array sent by
``(i)sendrecv``. How many bytes then cross the wire depends on MPI's algorithm (a ring
allreduce sends ``2 (n - 1) / n`` of the buffer); docs/model-parallel.md has the
formulas. ``*_obj``, ``check`` and ``barrier`` are counted as calls of 0 bytes.

Every method delegates explicitly (no attribute forwarding): the wrapper keeps the
contract of :class:`~mpidl.comm.base.Communicator` and each method's collective rules
are those of the wrapped communicator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpidl.comm.base import Communicator, Request


@dataclass
class Count:
    """Calls of one operation and the bytes they handed over."""

    calls: int = 0
    nbytes: int = 0


class CountingCommunicator(Communicator):
    """``comm`` with a tally of its traffic (:attr:`counts`), per operation name.

    Args:
        comm: the communicator to wrap; it stays usable and is not freed by
            :meth:`free` of a wrapper that did not split it.
    """

    def __init__(self, comm: Communicator) -> None:
        self.inner = comm
        self.rank, self.size = comm.rank, comm.size
        self.local_rank, self.local_size = comm.local_rank, comm.local_size
        self.counts: dict[str, Count] = {}
        self._owned = False

    def _count(self, op: str, nbytes: int = 0) -> None:
        c = self.counts.setdefault(op, Count())
        c.calls += 1
        c.nbytes += int(nbytes)

    def reset(self) -> None:
        """Forget what was counted so far (not collective)."""
        self.counts = {}

    def total(self, *ops: str) -> Count:
        """The sum of the counts of ``ops`` (all operations when none are named)."""
        names = ops or tuple(self.counts)
        out = Count()
        for name in names:
            c = self.counts.get(name, Count())
            out.calls += c.calls
            out.nbytes += c.nbytes
        return out

    # -- delegated operations, counted ---------------------------------------------------
    def allreduce_(self, x: Any, op: str = "sum") -> Any:
        self._count("allreduce_", x.nbytes)
        return self.inner.allreduce_(x, op)

    def iallreduce_(self, x: Any, op: str = "sum") -> Request:
        self._count("iallreduce_", x.nbytes)
        return self.inner.iallreduce_(x, op)

    def reduce_(self, x: Any, root: int = 0, op: str = "sum") -> Any:
        self._count("reduce_", x.nbytes)
        return self.inner.reduce_(x, root, op)

    def bcast_(self, x: Any, root: int = 0) -> Any:
        self._count("bcast_", x.nbytes)
        return self.inner.bcast_(x, root)

    def allgather(self, x: Any) -> Any:
        self._count("allgather", x.nbytes)
        return self.inner.allgather(x)

    def iallgather(self, x: Any) -> Request:
        self._count("iallgather", x.nbytes)
        return self.inner.iallgather(x)

    def allgatherv(self, x: Any) -> Any:
        self._count("allgatherv", x.nbytes)
        return self.inner.allgatherv(x)

    def reduce_scatter(self, x: Any, op: str = "sum") -> Any:
        self._count("reduce_scatter", x.nbytes)
        return self.inner.reduce_scatter(x, op)

    def alltoall(self, x: Any) -> Any:
        self._count("alltoall", x.nbytes)
        return self.inner.alltoall(x)

    def sendrecv(self, x: Any, dest: int, source: int) -> Any:
        self._count("sendrecv", x.nbytes)
        return self.inner.sendrecv(x, dest, source)

    def isendrecv(self, x: Any, dest: int, source: int) -> Request:
        self._count("isendrecv", x.nbytes)
        return self.inner.isendrecv(x, dest, source)

    def barrier(self) -> None:
        self._count("barrier")
        self.inner.barrier()

    def allgather_obj(self, obj: Any) -> list:
        self._count("allgather_obj")
        return self.inner.allgather_obj(obj)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        self._count("bcast_obj")
        return self.inner.bcast_obj(obj, root)

    def split(self, color: int, key: int | None = None) -> "CountingCommunicator":
        """Split the wrapped communicator; the new group counts on its own."""
        sub = CountingCommunicator(self.inner.split(color, key))
        sub._owned = True
        return sub

    def free(self) -> None:
        """Free the wrapped communicator if this wrapper made it (by :meth:`split`)."""
        if self._owned:
            self.inner.free()


__all__ = ["Count", "CountingCommunicator"]
