"""An unhandled exception on one rank aborts every rank, instead of a hung job.

Without this, a rank that dies leaves the others blocked forever in their next
collective, burning the allocation (ChainerMN's ``global_except_hook`` and
``python -m mpi4py`` solve it the same way). ``install()`` replaces ``sys.excepthook``
and ``threading.excepthook``: the failing rank prints its traceback, every line prefixed
``rank N/size: `` so it can be told apart in the merged job output, then calls
``MPI_Abort`` on ``COMM_WORLD``, which ends the whole job.

A :class:`~mpidl.comm.DistributedError` is raised by every rank together (that is its
contract), so it needs no abort: rank 0 prints it once and each rank exits with status 1.
"""
from __future__ import annotations

import sys
import threading
import traceback
from types import TracebackType

ABORT_EXIT_CODE = 1

_installed = False


def _world_position() -> tuple[int, int, object | None]:
    """(rank, size, COMM_WORLD or None) without initialising MPI as a side effect."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        w = mpi.COMM_WORLD
        return w.Get_rank(), w.Get_size(), w
    try:
        from hpc.env import detect

        e = detect()
        return e.rank, e.size, None
    except Exception:  # a malformed launcher variable must not hide the real error
        return 0, 1, None


def format_exception(rank: int, size: int, exc_type: type, exc: BaseException,
                     tb: TracebackType | None) -> str:
    """The traceback with every line prefixed ``rank N/size: ``."""
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    prefix = f"rank {rank}/{size}: "
    return "".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n"))


def _report_and_abort(exc_type: type, exc: BaseException, tb: TracebackType | None,
                      where: str = "") -> None:
    rank, size, comm = _world_position()
    from mpidl.comm.base import DistributedError

    if isinstance(exc, DistributedError) and not where and exc.group_size == size:
        if rank == 0:
            sys.stderr.write(f"mpidl: error: {exc}\n")
            sys.stderr.flush()
        return  # every rank raised it: normal exit with status 1, MPI finalizes cleanly
    # Anything else, a DistributedError of a sub-communicator included (the job's other
    # ranks did not raise it and would wait for these forever): report and abort.
    header = f"rank {rank}/{size}: unhandled exception{where}; aborting all {size} ranks\n"
    sys.stderr.write(header + format_exception(rank, size, exc_type, exc, tb))
    sys.stderr.flush()
    sys.stdout.flush()
    if comm is not None and size > 1:
        comm.Abort(ABORT_EXIT_CODE)


def _excepthook(exc_type: type, exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    _report_and_abort(exc_type, exc, tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    _report_and_abort(args.exc_type, args.exc_value, args.exc_traceback,  # type: ignore[arg-type]
                      where=f" in thread {name!r}")


def install() -> None:
    """Install the abort-all-ranks hooks (idempotent; never initialises MPI)."""
    global _installed
    if not _installed:
        sys.excepthook = _excepthook
        threading.excepthook = _thread_excepthook
        _installed = True
