"""``mpidl launch``: run ``mpiexec`` so that a SIGTERM stops the job cleanly (status 75).

A SIGTERM to Open MPI's ``mpiexec`` (``prterun``) aborts the job whatever the ranks do:
PRRTE's handler sends the ranks SIGCONT, SIGTERM and, a moment later, SIGKILL, then
exits with status 1 (``clean_abort`` in PRRTE's ``prte.c``; not configurable). A rank
that needs longer than that to write its checkpoint loses it, and the job's status says
"failed" where it was stopped. SIGUSR1, by contrast, ``mpiexec`` forwards to every rank
and then returns their status: the trainer checkpoints and exits 75 (``EX_TEMPFAIL``).

So this launcher runs ``mpiexec`` as a child and turns the first SIGTERM it receives
into a SIGUSR1 for it; a second SIGTERM is passed on as a SIGTERM (abort now). SIGUSR1
and SIGUSR2 are passed on as they are; SIGINT is left to ``mpiexec`` (Ctrl-C in a
terminal reaches both, and twice would force an abort). Its exit status is
``mpiexec``'s::

    mpidl launch -n 4 mpidl train            # as `mpiexec -n 4 mpidl train`
    kill -TERM <its pid>                     # checkpoint, then exit 75

A preemption (SIGTERM or SIGUSR1) at any moment ends in 75: one that arrives before
``mpiexec`` is started starts nothing; and when the SIGUSR1 it relayed killed the job
(status 138: ``mpiexec`` itself, or a rank, got it in its first milliseconds, before
Python had run a line of its code to catch it), nothing had begun either, so that is
reported as 75 too. Only the launcher's own first milliseconds, before its handlers,
are out of reach: a SIGTERM then ends it with 143, having started nothing.

A job that lost a node is never a success: measured with Open MPI 5.0.11, after a rank's
``MPI_Abort`` (the watchdog's, status 124) and then "PRTE has lost communication with a
remote daemon" (a node cut off), ``mpiexec`` exits **0**. The launcher reads mpiexec's
standard error on its way through, and where it said so and exited 0, exits with the
abort's error code instead (1 if none was given): a batch script trusting the status
would otherwise call a lost job done (tests/cluster/test_faults.py cuts a node's link).

Under Slurm, ``srun`` forwards SIGTERM to the tasks and returns their status, so
``srun mpidl train`` needs no wrapper.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from typing import IO, Sequence


def mpiexec_path() -> str:
    """The ``mpiexec`` next to this Python (the Open MPI wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError(
            "no mpiexec found next to the Python interpreter or on PATH; install the "
            "Open MPI wheel with `pip install mpidl[mpi]` or load your site's MPI module")
    return found


# Launchers asked, by (resolved path, modification time): a process that launches many
# jobs (a test suite: 260 launches in tests/integration) asks each launcher once; each
# `mpiexec --version` cost 0.01-0.25 s there. A launcher replaced in place is asked again.
_OPEN_MPI: dict[tuple[str, int], bool] = {}


def is_open_mpi(path: str) -> bool:
    """Whether the launcher at ``path`` is Open MPI's (asks it for its version, once per
    launcher file and process)."""
    found = shutil.which(path) or path
    try:
        key = (os.path.realpath(found), os.stat(found).st_mtime_ns)
    except OSError:
        return False
    if key not in _OPEN_MPI:
        try:
            out = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return False  # not remembered: a timeout under load is not an answer
        text = out.stdout + out.stderr
        _OPEN_MPI[key] = "Open MPI" in text or "OpenRTE" in text
    return _OPEN_MPI[key]


# Relayed to mpiexec's ranks, it asks them to checkpoint and stop (mpidl.train.signals).
PREEMPT_SIGNAL = signal.SIGUSR1
EXIT_PREEMPTED = 75  # EX_TEMPFAIL, as mpidl.train.signals (hpc does not import mpidl)


class _Relay:
    """The launcher's signal handlers: what each signal becomes for the child. Signals
    that arrive before the child exists wait in ``pending`` (:meth:`attach` sends them)."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.pending: list[int] = []
        self.terms = 0
        self.preempted = False  # a SIGUSR1 was (or is to be) relayed

    def __call__(self, signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            self.terms += 1
            if self.terms == 1:
                sys.stderr.write("mpidl launch: SIGTERM: asking the ranks to checkpoint and "
                                 "stop (SIGUSR1 to mpiexec); send SIGTERM again to abort\n")
                sys.stderr.flush()
                signum = PREEMPT_SIGNAL
        if signum == PREEMPT_SIGNAL:
            self.preempted = True
        if self.child is None:
            self.pending.append(signum)
            return
        self._send(signum)

    def _send(self, signum: int) -> None:
        try:
            self.child.send_signal(signum)
        except ProcessLookupError:  # it has just ended
            pass

    def attach(self, child: subprocess.Popen) -> None:
        """From now on signals go to ``child``; those that came while it started, too."""
        self.child = child
        while self.pending:
            self._send(self.pending.pop(0))


# What Open MPI's mpiexec writes when a node's daemon is gone, and when a rank aborted.
LOST_DAEMON = b"lost communication with a remote daemon"
ABORT_CODE = re.compile(rb"MPI_ABORT was invoked.*?Errorcode: (\d+)", re.S)
# How long the launcher waits, after mpiexec ended, for the rest of its standard error: a
# daemon cut off from it may hold the pipe open for ever (tests/cluster/cluster.sh reap).
TAIL_WAIT_S = 5.0


class _Errors:
    """Copies mpiexec's standard error to ours as it comes, and keeps what a lost daemon
    and an abort said (the lines that follow them are kept, to find the error code)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.seen = bytearray()
        self.lost = False
        self._thread = threading.Thread(target=self._copy, args=(stream,), daemon=True)
        self._thread.start()

    def _copy(self, stream: IO[bytes]) -> None:
        out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        for line in iter(stream.readline, b""):
            if out is not None:
                out.write(line)
                out.flush()
            else:  # pragma: no cover - a stderr without bytes (an embedding)
                sys.stderr.write(line.decode(errors="replace"))
            self.lost = self.lost or LOST_DAEMON in line
            if b"MPI_ABORT was invoked" in line or (self.seen and len(self.seen) < 4096):
                self.seen += line

    def status(self, code: int) -> int:
        """mpiexec's status, or the abort's (1 if none) where it lost a daemon and said 0."""
        self._thread.join(TAIL_WAIT_S)
        if code != 0 or not self.lost:
            return code
        found = ABORT_CODE.search(bytes(self.seen))
        status = int(found.group(1)) if found else 1
        why = "the MPI_Abort's error code" if found else "no MPI_Abort said why"
        print(f"mpidl launch: mpiexec exited 0 after losing a node's daemon; exiting with "
              f"{status} ({why})", file=sys.stderr, flush=True)
        return status


def main(argv: Sequence[str]) -> int:
    """``mpidl launch [--launcher=PATH] MPIEXEC_ARGUMENTS...``; returns mpiexec's status
    (75 for a job preempted before it could catch the signal: see the module's text)."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n", 1)[1].rstrip() + "\n\nusage: mpidl launch "
              "[--launcher=PATH] MPIEXEC_ARGUMENTS...  (default launcher: the mpiexec "
              "next to this Python, else on PATH)")
        return 0 if argv else 2
    # The handlers first: a SIGTERM from here on is relayed, never the launcher's death
    # (which would leave mpiexec and the ranks running without it). Not restored at the
    # end: this process ends with mpiexec.
    relay = _Relay()
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, relay)
    launcher = None
    if argv[0].startswith("--launcher="):
        launcher, argv = argv[0].split("=", 1)[1], argv[1:]
    try:
        command = [launcher or mpiexec_path(), *argv]
        if relay.preempted:
            print(f"mpidl launch: preempted before mpiexec started: nothing started; exiting "
                  f"with {EXIT_PREEMPTED} (run it again)", file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
        child = subprocess.Popen(command, stderr=subprocess.PIPE)
    except (FileNotFoundError, PermissionError) as e:
        print(f"mpidl launch: error: cannot run the launcher: {e}", file=sys.stderr)
        return 2
    relay.attach(child)  # and sends what came since the check above
    errors = _Errors(child.stderr)
    # Not before the start: mpiexec would inherit an ignored SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
    status = errors.status(code if code >= 0 else 128 - code)  # killed: the shell's way
    if relay.preempted and status == 128 + PREEMPT_SIGNAL:
        print(f"mpidl launch: the job ended by the {PREEMPT_SIGNAL.name} that asked it to "
              "stop, before a rank (or mpiexec) could catch it: it was starting and had done "
              f"nothing yet; exiting with {EXIT_PREEMPTED} (preempted: run it again)",
              file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return status
