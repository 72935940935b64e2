"""Preemption: turn SIGTERM / SIGUSR1 into a flag that every phase of the job checks.

Slurm signals a job before it ends it: at a time limit or a preemption it sends SIGTERM
(then SIGKILL after ``KillWait``, 30 s by default), and ``#SBATCH --signal=USR1@120``
asks for SIGUSR1 two minutes before the limit. ``srun`` delivers the signal to every
task. (Under Open MPI's ``mpirun`` a SIGTERM to mpirun tears the job down itself, exit
status 1 whatever the ranks do; send SIGUSR1, which mpirun forwards to the ranks, signal
the ranks directly, or start the job with ``mpidl launch`` (:mod:`hpc.launch`), which
turns a SIGTERM into that SIGUSR1.)

The handler only sets a flag: no I/O or MPI inside a signal handler. ``mpidl train``
(:mod:`mpidl.train.command`) creates the flag as its first instruction, before any heavy
import, and keeps it until the process ends; every phase then checks it at its safe
points, agreeing across ranks (:meth:`PreemptionFlag.agree`, an allreduce of max, so
every rank stops at the same point even if only some were signalled): after MPI and
the configuration are up, during the corpus build (a temporary folder that is removed),
after the trainer is built and the resume planned, at each step boundary, and at the
end. During training the trainer writes a checkpoint first; before it, there is nothing
to save. Either way the job exits with :data:`EXIT_PREEMPTED`::

    preempt = PreemptionFlag()          # the job's first instruction
    ...
    for step in ...:
        train_step()
        if preempt.agree(comm):
            save_checkpoint(...)
            return EXIT_PREEMPTED

A requeued job (``scontrol requeue``, or ``--requeue`` with preemption) resumes from
that checkpoint by itself (``resume = "auto"``). Libraries never install the handlers
(process-wide state); they take the job's flag, or a :class:`PreemptionFlag` of no
signals, which is never set.

What no Python code can catch: a signal in the first tens of milliseconds of a rank,
while the interpreter starts, still kills it (status 128 + the signal). ``mpidl launch``
reports such a death, after it relayed a preemption, as 75: nothing had started.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Sequence

# EX_TEMPFAIL in sysexits.h: "temporary failure, the user is invited to retry". A batch
# script can requeue on it: `srun mpidl train ...; [ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID`.
EXIT_PREEMPTED = 75

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(Exception):
    """Raised on every rank together when the ranks agreed to stop before training
    began (nothing to checkpoint); ``mpidl train`` exits with :data:`EXIT_PREEMPTED`.

    Args:
        during: what the job was doing, for the message ("generating the corpus").
        signal_name: the signal this rank received, or None (another rank's).
    """

    def __init__(self, during: str, signal_name: str | None = None) -> None:
        super().__init__(f"preempted ({signal_name or 'signal on another rank'}) while "
                         f"{during}")
        self.during, self.signal_name = during, signal_name


class PreemptionFlag:
    """Handlers for ``signals`` that set a flag; the previous handlers come back on close.

    Must be created in the main thread (Python runs signal handlers there only).

    Args:
        signals: signal names or numbers to catch; SIGTERM and SIGUSR1 by default. None
            installs nothing: a flag that is never set, for a library call that the job
            did not give its flag (any thread may make it).

    Attributes:
        signum: the first signal received, or None.
    """

    def __init__(self, signals: Sequence[str | int] | None = DEFAULT_SIGNALS) -> None:
        signals = signals or ()
        if signals and threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionFlag must be created in the main thread "
                               "(Python delivers signals to the main thread only)")
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        for sig in signals:
            num = int(getattr(signal, sig)) if isinstance(sig, str) else int(sig)
            self._previous[num] = signal.signal(num, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def is_set(self) -> bool:
        """True once one of the signals arrived on this rank."""
        return self.signum is not None

    def __bool__(self) -> bool:
        return self.is_set

    @property
    def signal_name(self) -> str | None:
        """``"SIGTERM"``, ``"SIGUSR1"``... of the first signal received, or None."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def agree(self, comm: Any) -> bool:
        """True on every rank if any rank got a signal.

        Collective: every rank of ``comm`` (an :class:`mpidl.comm.Communicator`) calls it at
        the same step boundary. It costs one 4-byte allreduce.
        """
        return comm.agree_each(self.is_set)[0]

    def check(self, comm: Any, during: str) -> None:
        """Raise :class:`Preempted` on every rank if any rank got a signal: a safe point
        of a phase before training, where stopping loses nothing. Collective."""
        if self.agree(comm):
            raise Preempted(during, self.signal_name)

    def close(self) -> None:
        """Restore the handlers that were installed before (idempotent)."""
        for num, previous in self._previous.items():
            signal.signal(num, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> "PreemptionFlag":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
