"""The Communicator contract shared by the MPI and the single-process implementations.

Every method is collective unless its docstring says otherwise: all ranks of the group
call it, in the same order, with arrays of the same shape and dtype (the exceptions,
``allgatherv`` and ``*_obj``, say what may differ). Arrays are NumPy or CuPy; results
are arrays of the same module.
"""
from __future__ import annotations

from typing import Any, Sequence

OPS = ("sum", "max", "min", "prod")
MAX_TAG = 8192  # point-to-point tags are below it (MPI maps them under its least MPI_TAG_UB)


class DistributedError(RuntimeError):
    """An error that every rank of a communicator raises together.

    Raised by :meth:`Communicator.check` on all ranks when any rank failed a check, so
    the job ends cleanly instead of hanging in the next collective.

    Attributes:
        failed_ranks: the ranks that reported the failure.
        messages: rank -> that rank's message, for the failing ranks.
        group_size: the size of the communicator whose ranks all raised it (None when
            unknown): on a sub-communicator, the job's other ranks did not, and the
            exception hook must abort them (:mod:`mpidl.excepthook`).
    """

    def __init__(self, message: str, failed_ranks: Sequence[int] = (),
                 messages: dict[int, str] | None = None,
                 group_size: int | None = None) -> None:
        super().__init__(message)
        self.failed_ranks = list(failed_ranks)
        self.messages = dict(messages or {})
        self.group_size = group_size


def check_tag(tag: int) -> int:
    """Validate a point-to-point tag; returns it (not collective)."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < MAX_TAG:
        raise ValueError(f"tag={tag!r}: a point-to-point tag is an int in [0, {MAX_TAG})")
    return tag


def check_op(op: str) -> str:
    """Validate a reduction name; returns it lower-cased (not collective)."""
    name = op.lower()
    if name not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; use one of {', '.join(OPS)}")
    return name


def check_reducible(x: Any, what: str, op: Any = "sum") -> None:
    """Raise TypeError for an array MPI cannot reduce; the same on every communicator.

    MPI has no reduction for booleans, mpi4py refuses non-native byte order (h5py
    returns it for big-endian files), and mpidl reduces float16 only by summing
    (:mod:`mpidl.comm.datatypes`: no MPI float16 type on every library) and bfloat16
    not at all (no MPI type: MpiCommunicator refuses it, so every one does). A single rank
    would reduce any of them without complaint and the script then fail on two: so
    every communicator checks.
    """
    dtype = x.dtype
    if dtype.name == "bfloat16" and isinstance(op, str):  # as datatypes.reducible on MPI
        raise TypeError(f"{what} of a bfloat16 array: MPI has no bfloat16 type, and a "
                        "bfloat16 sum rounds every add to 8 bits; reduce "
                        "x.astype(numpy.float32)")
    if dtype == "float16" and isinstance(op, str) and check_op(op) != "sum":
        raise TypeError(f"{what} of a float16 array with op={op!r}: MPI has no 16-bit float "
                        "type on every library, and mpidl sums float16 only; reduce "
                        "x.astype(numpy.float32)")
    if dtype.kind == "b":
        raise TypeError(f"{what} of a bool array: MPI has no reduction for booleans; "
                        "reduce x.astype(numpy.uint8) (max is any, min is all)")
    if not dtype.isnative:
        raise TypeError(f"{what} of a {dtype.str!r} array (non-native byte order, as h5py "
                        "returns for big-endian files); reduce "
                        "x.astype(x.dtype.newbyteorder('='))")


def split_counts(n: int, parts: int) -> list[int]:
    """``n`` items into ``parts`` nearly equal counts, the first ``n % parts`` one larger.

    The one splitting rule of mpidl (reduce_scatter blocks, per-rank batch shares).
    """
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


class Communicator:
    """A fixed group of ranks.

    Every method is collective unless its docstring says otherwise: all ranks of the
    group call it, in the same order, with arrays of the same shape and dtype.

    Attributes:
        rank: this process's rank in the group, ``0 <= rank < size``.
        size: number of ranks.
        local_rank: rank among the group's ranks on this node.
        local_size: number of the group's ranks on this node.
    """

    rank: int = 0
    size: int = 1

    # -- agreement ------------------------------------------------------------------
    def check(self, ok: bool, message: str) -> None:
        """Raise DistributedError on every rank if ``ok`` is False on any rank.

        Collective: all ranks call it. The error names the failing ranks and carries
        each failing rank's ``message`` (ranks that passed may pass any message).
        """
        results = self.allgather_obj((bool(ok), None if ok else str(message)))
        failed = [r for r, (good, _) in enumerate(results) if not good]
        if not failed:
            return
        messages = {r: results[r][1] for r in failed}
        lines = [f"rank {r}: {messages[r]}" for r in failed]
        summary = f"check failed on rank{'s' if len(failed) > 1 else ''} " \
                  f"{', '.join(map(str, failed))} of {self.size}"
        raise DistributedError(summary + "\n" + "\n".join(lines), failed, messages,
                               group_size=self.size)

    def agree(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any rank (a logical OR).

        Collective. Use it where ranks must take the same branch, for example
        "stop at this step boundary" after a signal reached only some ranks.
        """
        return any(self.allgather_obj(bool(flag)))

    def agree_each(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag True on every rank if it is True on any rank. Collective.

        One small buffer allreduce for all of them: the training step agrees on "a
        signal arrived" and "this step is not finite" in one call.
        """
        import numpy

        values = numpy.array([1 if f else 0 for f in flags], dtype=numpy.int32)
        return tuple(bool(v) for v in self.allreduce_(values, op="max"))

    # -- the collectives every implementation provides ----------------------------------
    def allreduce_(self, x: Any, op: str = "sum") -> Any:
        raise NotImplementedError

    def allreduce(self, x: Any, op: str = "sum") -> Any:
        """Return a new array: the elementwise reduction of ``x`` over all ranks.

        Collective: same shape and dtype on every rank.
        """
        y = x.copy()
        return self.allreduce_(y, op)

    def reduce_(self, x: Any, root: int = 0, op: str = "sum") -> Any:
        raise NotImplementedError

    def bcast_(self, x: Any, root: int = 0) -> Any:
        raise NotImplementedError

    def allgather(self, x: Any) -> Any:
        raise NotImplementedError

    def allgatherv(self, x: Any) -> Any:
        raise NotImplementedError

    def reduce_scatter(self, x: Any, op: str = "sum") -> Any:
        raise NotImplementedError

    def alltoall(self, x: Any) -> Any:
        raise NotImplementedError

    def sendrecv(self, x: Any, dest: int, source: int) -> Any:
        raise NotImplementedError

    def iallreduce_(self, x: Any, op: str = "sum") -> "Request":
        raise NotImplementedError

    def isendrecv(self, x: Any, dest: int, source: int) -> "Request":
        raise NotImplementedError

    def iallgather(self, x: Any) -> "Request":
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    # -- point to point: not collective, only this rank and its peer -------------------
    def isend(self, x: Any, dest: int, tag: int = 0) -> "Request":
        """Start sending ``x`` to rank ``dest``; ``wait()`` returns None once ``x`` may
        be written again.

        Point-to-point (not collective): ``dest`` must post a receive from this rank
        with the same ``tag`` (``0 <= tag <`` :data:`MAX_TAG`) into an array of ``x``'s
        shape and dtype. Messages from one rank to another with the same tag are
        received in the order they were sent (MPI's non-overtaking rule); different
        tags do not match each other.
        """
        raise NotImplementedError

    def irecv_(self, x: Any, source: int, tag: int = 0) -> "Request":
        """Start receiving the message of rank ``source`` with ``tag`` into ``x``;
        ``wait()`` returns ``x``, filled.

        Point-to-point, the other half of :meth:`isend`. ``x`` must have the sender's
        shape and dtype: a message of another size is a
        :class:`DistributedError` naming both ranks, and under
        ``MPIDL_CHECK_COLLECTIVES=1`` so is one of another shape or dtype (with the
        sender's call site).
        """
        raise NotImplementedError

    def send(self, x: Any, dest: int, tag: int = 0) -> None:
        """Send ``x`` to ``dest`` and return once ``x`` may be written again.

        Point-to-point, as :meth:`isend`. It may wait until ``dest`` receives (MPI's
        rendezvous protocol for large messages), so two ranks that both send to each
        other before receiving can deadlock: post :meth:`irecv_` and :meth:`isend`
        together and wait for both (:mod:`mpidl.parallel.pipeline` does).
        """
        self.isend(x, dest, tag).wait()

    def recv_(self, x: Any, source: int, tag: int = 0) -> Any:
        """Receive the message of ``source`` with ``tag`` into ``x``; returns ``x``.

        Point-to-point, as :meth:`irecv_`.
        """
        return self.irecv_(x, source, tag).wait()

    def prepare_device(self) -> None:
        """Decide now how device arrays reach this group's point-to-point calls.

        Collective. Where the decision needs the group (an MPI probe), point-to-point
        calls of device arrays refuse to run before it; nothing to do elsewhere.
        """

    def allgather_obj(self, obj: Any) -> list:
        raise NotImplementedError

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        raise NotImplementedError

    def split(self, color: int, key: int | None = None) -> "Communicator":
        raise NotImplementedError

    def free(self) -> None:
        """Release the underlying MPI communicator (not collective for size 1)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class Request:
    """Handle of a non-blocking operation (returned by ``iallreduce_`` and ``isendrecv``).

    Not collective by itself, but every rank must eventually ``wait()`` on its handle.
    """

    def test(self) -> bool:
        """Progress the operation; True when it has completed (never blocks)."""
        return True

    def wait(self) -> Any:
        """Block until complete; returns the result array (the in-place buffer)."""
        raise NotImplementedError


class CompletedRequest(Request):
    """A request that was complete when made (size-1 groups)."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result
