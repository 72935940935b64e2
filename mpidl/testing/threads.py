"""Ranks as threads: a communicator for unit tests of collective code, without mpiexec.

:func:`run_ranks` runs ``fn(comm, *args)`` on ``size`` threads, each with its own
:class:`ThreadCommunicator` of one group, and returns what each rank returned, in rank
order. The communicator keeps the semantics of :class:`~mpidl.comm.mpi.MpiCommunicator`
(in-place buffers written in place, results fresh arrays, float16 reduced by sum only,
``split`` ordered like ``MPI_Comm_split``), so a wrapper's collective order, scaling
and empty-rank behaviour are tested in milliseconds::

    def train(comm, x, y):
        dp = DataParallel(mlp(sizes=(7, 11, 5), seed=4), comm, shared_memory=False)
        start = sum(split_counts(len(x), comm.size)[:comm.rank])
        ...
        return [call.name for call in comm.calls]

    names = run_ranks(3, train, x, y)      # names[r]: rank r's calls

Where MPI would hang or silently pair different calls, this fails loudly on every rank:
each collective first compares its name, shape, dtype, op and root across the ranks
(as ``MPIDL_CHECK_COLLECTIVES=1`` does on MPI); a rank that never arrives is named after
``timeout`` seconds (at once when its function has returned); an exception on one rank
ends the others' waits at once (ChainerMN's ``global_except_hook``), and the caller gets
the exception of the lowest rank that raised first-hand, with its rank noted.

Non-blocking calls: a collective started with ``iallreduce_``/``iallgather`` hands over
its part at start and completes at ``wait()`` (or a ``test()`` that finds every rank's
part), so, as MPI requires, every rank must start its collectives in the same order,
blocking and non-blocking together; a rank that starts them in another order gets the
mismatch error. ``isendrecv`` deposits its message in a per-(source, dest) FIFO when it
starts and receives at ``wait()``: every order MPI's eager sends allow works. So do
``isend`` (deposited at start) and ``irecv_`` (at ``wait()``), per tag.

Where the ranks meet (rounds, mailboxes, the comparison of calls, the waits and their
errors) is :mod:`mpidl.testing.rendezvous`; how a reduction folds the ranks' parts,
:mod:`mpidl.testing.thread_ops`; this module is the communicator's methods and
:func:`run_ranks`.

What it does not model:

- MPI's progress and timing: no message is ever "in flight", sums fold in rank order
  (a float sum may differ from MPI's in the last bits, as two MPI libraries do), and
  a deadlock that only a rendezvous protocol would show may pass here.
- Shared memory between processes: there is no ``node_comm``, so data parallelism never
  chooses its MPI shared-memory window, and a hierarchical transport needs an explicit
  ``ranks_per_node``. No device (CuPy) staging either.
- Process isolation: every rank shares the process's global state: NumPy's global RNG
  (draw from a per-rank ``numpy.random.default_rng``), module-level caches, the
  environment, and ``mpidl.comm.world()`` (a world of one: pass ``comm`` explicitly).
  Process-wide tools see every rank at once: ``tracemalloc`` (so
  :func:`mpidl.testing.memory.peak_bytes` measures all ranks, and starting and stopping
  it on several ranks together crashed CPython 3.11), and signal handlers (only the
  main thread may install them: ``PreemptionFlag`` refuses a rank's thread).
  Grad mode of :mod:`mpidl.autograd` is thread-local (``no_grad`` on one rank does not
  reach another), so forward and backward in the ranks' threads are safe.
"""
from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable

import numpy

from mpidl.backend import get_array_module
from mpidl.comm import base
from mpidl.comm.base import (Communicator, DistributedError, Request, check_op,
                             check_reducible, split_counts)
from mpidl.testing.rendezvous import (PENDING, Call, Group, Rendezvous, ThreadRequest, World,
                                      rank_list)
from mpidl.testing.thread_ops import FOLDS, wire_sum


class ThreadCommunicator(Rendezvous, Communicator):
    """One rank's handle on a group of thread ranks; made by :func:`run_ranks` and split.

    Keeps the contract of :class:`~mpidl.comm.base.Communicator` and the semantics of
    :class:`~mpidl.comm.mpi.MpiCommunicator`; every call is appended to :attr:`calls`.

    Attributes:
        calls: this rank's calls on this communicator, in order (:class:`Call`).
        local_rank, local_size: among the group's ranks on this rank's "node" (with
            ``run_ranks(ranks_per_node=k)``, world ranks ``k*i .. k*i + k - 1``).
    """

    # -- reductions -------------------------------------------------------------------
    def allreduce_(self, x: Any, op: Any = "sum") -> Any:
        """Reduce ``x`` elementwise over all ranks, in place; returns ``x``.

        Collective: every rank passes a C-contiguous array of the same shape and dtype
        and the same ``op`` ("sum", "max", "min", "prod", or one of mpidl's 16-bit wire
        sums, :func:`mpidl.parallel.compression.wire_sum_op`).
        """
        label, fold = self._reducer(x, op, "allreduce_")
        parts = self._collective(self._record("allreduce_", x, op=label), x.copy())
        x[...] = fold(parts)
        return x

    def iallreduce_(self, x: Any, op: Any = "sum") -> Request:
        """Start :meth:`allreduce_`; ``x`` holds the result after ``wait()``.

        Collective as allreduce_; ``x`` is read at the start (it may not be written
        until ``wait()``, as on MPI). Start order must match across ranks.
        """
        label, fold = self._reducer(x, op, "iallreduce_")
        call = self._record("iallreduce_", x, op=label)
        n = self._start(call, x.copy())

        def complete(block: bool) -> Any:
            parts = self._finish(n, call, block)
            if parts is None:
                return PENDING
            x[...] = fold(parts)
            return x

        return ThreadRequest(complete)

    def reduce_(self, x: Any, root: int = 0, op: Any = "sum") -> Any:
        """Reduce ``x`` over all ranks into root's ``x``, in place; returns ``x``.

        Collective: same shape, dtype, ``root`` and ``op`` everywhere. The other ranks'
        ``x`` are left as they were.
        """
        self._check_peer(root, "root")
        label, fold = self._reducer(x, op, "reduce_")
        parts = self._collective(self._record("reduce_", x, op=label, root=root), x.copy())
        if self.rank == root:
            x[...] = fold(parts)
        return x

    def reduce_scatter(self, x: Any, op: Any = "sum") -> Any:
        """Reduce ``x`` over all ranks and return this rank's block (a new array).

        ``x`` splits along axis 0 by :func:`~mpidl.comm.base.split_counts`; rank r
        receives block r. Collective: same shape, dtype and ``op`` on every rank.
        """
        _need_rows(x, "reduce_scatter")
        label, fold = self._reducer(x, op, "reduce_scatter", contiguous=False)
        parts = self._collective(self._record("reduce_scatter", x, op=label), x.copy())
        rows = split_counts(x.shape[0], self.size)
        start = sum(rows[:self.rank])
        return fold([p[start:start + rows[self.rank]] for p in parts])

    # -- data movement ----------------------------------------------------------------
    def bcast_(self, x: Any, root: int = 0) -> Any:
        """Overwrite every rank's ``x`` with root's, in place; returns ``x``.

        Collective: same shape and dtype everywhere, same ``root``.
        """
        self._check_peer(root, "root")
        _contiguous(x, "bcast_")
        mine = x.copy() if self.rank == root else None
        parts = self._collective(self._record("bcast_", x, root=root), mine)
        if self.rank != root:
            x[...] = parts[root]
        return x

    def allgather(self, x: Any) -> Any:
        """Every rank's ``x`` stacked: shape ``(size, *x.shape)``, row r from rank r.

        Collective: same shape and dtype on every rank.
        """
        parts = self._collective(self._record("allgather", x), x.copy())
        return get_array_module(x).stack(parts)

    def iallgather(self, x: Any) -> Request:
        """Start :meth:`allgather`; ``wait()`` returns the ``(size, *shape)`` result.

        Collective as allgather; ``x`` is read at the start. Start order must match.
        """
        call = self._record("iallgather", x)
        n = self._start(call, x.copy())
        xp = get_array_module(x)

        def complete(block: bool) -> Any:
            parts = self._finish(n, call, block)
            return PENDING if parts is None else xp.stack(parts)

        return ThreadRequest(complete)

    def allgatherv(self, x: Any) -> Any:
        """Every rank's ``x`` concatenated along axis 0, in rank order.

        Collective: ``x.shape[1:]`` and dtype must match on every rank; ``x.shape[0]``
        may differ (zero included).
        """
        _need_rows(x, "allgatherv")
        parts = self._collective(self._record("allgatherv", x), x.copy())
        return get_array_module(x).concatenate(parts, axis=0)

    def alltoall(self, x: Any) -> Any:
        """Block ``x[j]`` goes to rank j; returns ``y`` with ``y[i]`` = rank i's ``x[rank]``.

        Collective: ``x.shape[0] == size`` and the same shape and dtype on every rank.
        """
        if x.shape[:1] != (self.size,):
            raise ValueError(f"alltoall needs x.shape[0] == size == {self.size}, "
                             f"got shape {x.shape}")
        parts = self._collective(self._record("alltoall", x), x.copy())
        return get_array_module(x).stack([p[self.rank] for p in parts])

    def barrier(self) -> None:
        """Wait until every rank has called barrier. Collective."""
        self._collective(self._record("barrier"), None)

    def allgather_obj(self, obj: Any) -> list:
        """The list of every rank's ``obj``, pickled as mpi4py does (small metadata).

        Collective; the objects may differ between ranks. An object MPI cannot pickle
        fails here too.
        """
        mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        parts = self._collective(self._record("allgather_obj"), mine)
        return [pickle.loads(p) for p in parts]

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Root's ``obj`` on every rank, root included (a pickled copy).

        Collective; non-root ranks may pass anything (None).
        """
        self._check_peer(root, "root")
        mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == root else None
        parts = self._collective(self._record("bcast_obj", root=root), mine)
        return pickle.loads(parts[root])

    # -- point to point ---------------------------------------------------------------
    def sendrecv(self, x: Any, dest: int, source: int) -> Any:
        """Send ``x`` to ``dest``; return the array received from ``source`` (new).

        Point-to-point in pairs: ``source`` must send this rank an array of the same
        shape and dtype.
        """
        return self._exchange("sendrecv", x, dest, source).wait()

    def isendrecv(self, x: Any, dest: int, source: int) -> Request:
        """Start sending ``x`` to ``dest`` and receiving from ``source``; ``wait()``
        returns the received array.

        Point-to-point: the message is deposited now and received at ``wait()``;
        several exchanges between the same ranks match in the order they were started
        (MPI's non-overtaking rule).
        """
        return self._exchange("isendrecv", x, dest, source)

    def isend(self, x: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``x`` to ``dest`` with ``tag``: deposited (a copy) now, as an
        eager MPI send; ``wait()`` returns None. Point-to-point (see
        :meth:`~mpidl.comm.base.Communicator.isend`)."""
        return self._exchange("isend", x, dest, None, base.check_tag(tag))

    def irecv_(self, x: Any, source: int, tag: int = 0) -> Request:
        """Start receiving ``source``'s message with ``tag`` into ``x``; ``wait()``
        returns ``x``. Another shape or dtype than the sender's is a DistributedError
        naming both ranks and both call sites; a sender that never sends is named after
        ``timeout`` (at once when its function has returned)."""
        _contiguous(x, "irecv_")
        return self._exchange("irecv_", None, None, source, base.check_tag(tag), into=x)

    # -- groups -----------------------------------------------------------------------
    def split(self, color: int, key: int | None = None) -> "ThreadCommunicator":
        """Ranks passing the same ``color`` form a new communicator.

        Collective over this group. New ranks are ordered by ``key`` (default: the rank
        here), ties by the rank here, as ``MPI_Comm_split`` orders them.
        """
        if isinstance(color, bool) or not isinstance(color, (int, numpy.integer)) or color < 0:
            raise ValueError(f"split(color={color!r}): color must be an int >= 0 "
                             "(MPI_UNDEFINED is not supported: give every rank a group)")
        call = self._record("split")
        n = self._start(call, (int(color), self.rank if key is None else int(key)))
        parts = self._finish(n, call)
        members = sorted((r for r in range(self.size) if parts[r][0] == color),
                         key=lambda r: (parts[r][1], r))
        g, world = self._group, self._group.world
        ident = (id(g), n, int(color))
        with world.cond:
            entry = world.splits.get(ident)
            if entry is None:
                label = f"{g.label}/split #{call.seq} color {color}"
                entry = world.splits[ident] = [
                    Group(world, tuple(g.members[r] for r in members), label), len(members)]
            entry[1] -= 1
            if entry[1] == 0:
                del world.splits[ident]
        return ThreadCommunicator(entry[0], members.index(self.rank))

    def free(self) -> None:
        """Retire this communicator; any later call on it raises. Collective (a second
        ``free`` does nothing, as on MpiCommunicator)."""
        if not self._freed:
            self._collective(self._record("free"), None)
            self._freed = True

    # -- what a reduction computes ----------------------------------------------------
    def _reducer(self, x: Any, op: Any, what: str,
                 contiguous: bool = True) -> tuple[str, Callable[[list], Any]]:
        """The checks MPI makes first, then the op's name and its rank-order fold."""
        if contiguous:
            _contiguous(x, what)
        check_reducible(x, what, op)
        if isinstance(op, str):
            return check_op(op), FOLDS[check_op(op)]
        return wire_sum(x, op, what)


def _contiguous(x: Any, what: str) -> None:
    if not x.flags.c_contiguous:
        raise ValueError(f"{what} needs a C-contiguous array (got shape {x.shape}, strides "
                         f"{x.strides}); pass xp.ascontiguousarray(x)")


def _need_rows(x: Any, what: str) -> None:
    if x.ndim == 0:
        raise ValueError(f"{what} splits or joins along axis 0: got a 0-d array; "
                         "pass x.reshape(1)")


def run_ranks(size: int, fn: Callable[..., Any], *args: Any, timeout: float = 20.0,
              ranks_per_node: int | None = None, return_exceptions: bool = False,
              **kwargs: Any) -> list:
    """Run ``fn(comm, *args, **kwargs)`` on ``size`` thread ranks; their results in order.

    Each rank gets its own :class:`ThreadCommunicator` of one group of ``size`` ranks.

    Args:
        size: the number of ranks (threads), >= 1.
        fn: called once per rank with that rank's communicator first.
        timeout: seconds a rank waits in a call for the others before it raises
            DistributedError naming the ranks that never arrived; also how long, after a
            rank failed, the others are given to return.
        ranks_per_node: consecutive blocks of this many ranks form a "node" (what
            ``local_rank`` and ``local_size`` say); None: all ranks on one node.
        return_exceptions: return each failed rank's exception in place of its result
            instead of raising.

    Raises:
        BaseException: what the function of the lowest rank that failed first-hand
            raised (not the "another rank failed" errors of the others), with a note
            (Python 3.10: a cause) naming the rank.
    """
    if isinstance(size, bool) or int(size) != size or size < 1:
        raise ValueError(f"run_ranks(size={size!r}): need a whole number of ranks, >= 1")
    size = int(size)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be >= 1 (or None: one node)")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds")
    world = World(size, ranks_per_node, timeout)
    group = Group(world, tuple(range(size)), "world")
    comms = [ThreadCommunicator(group, r) for r in range(size)]
    results: list[Any] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(comms[rank], *args, **kwargs)
        except BaseException as e:  # pytest.fail and skip too: the caller re-raises them
            with world.cond:
                world.errors[rank] = e
        finally:
            with world.cond:
                world.ended.add(rank)
                world.cond.notify_all()

    threads = [threading.Thread(target=body, args=(r,), name=f"mpidl-rank-{r}", daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    with world.cond:
        deadline = None
        while len(world.ended) < size:
            if world.errors and deadline is None:
                deadline = time.monotonic() + timeout
            if deadline is not None and time.monotonic() >= deadline:
                break  # the rest are stuck outside any call (daemon threads: left behind)
            world.cond.wait(1.0 if deadline is None else
                            max(0.0, min(1.0, deadline - time.monotonic())))
        errors, failed = dict(world.errors), world.failed()
        stuck = sorted(set(range(size)) - world.ended)
    for r in stuck:
        errors[r] = DistributedError(f"{rank_list(stuck)} did not return within {timeout:g} s "
                                     "after a rank failed", stuck)
    if return_exceptions:
        return [errors.get(r, results[r]) for r in range(size)]
    if errors:
        r = min(failed or errors)  # an abort only where no rank has an error of its own
        e = errors[r]
        note = f"raised on rank {r} of {size} (mpidl.testing.run_ranks)"
        if stuck:
            note += f"; {rank_list(stuck)} never returned"
        if hasattr(e, "add_note"):
            e.add_note(note)
        elif e.__cause__ is None:  # Python 3.10: no notes; the chain names the rank
            e.__cause__ = DistributedError(note, [r])
        raise e
    return results


__all__ = ["Call", "ThreadCommunicator", "run_ranks"]
