"""``mpidl launch``: run ``mpiexec`` so that a SIGTERM stops the job cleanly (status 75),
the same under Open MPI, MPICH and Intel MPI.

Each MPI's ``mpiexec`` treats signals its own way (:data:`FAMILIES`, measured with Open
MPI 5.0.11, MPICH 5.0.2's Hydra and Intel MPI 2021.18's Hydra, from mpi4py's wheels):

- Open MPI's (``prterun``) aborts the job on a SIGTERM whatever the ranks do (SIGCONT,
  SIGTERM, then SIGKILL to the ranks, exit 1: ``clean_abort`` in PRRTE's ``prte.c``), so
  a rank that needs longer to write its checkpoint loses it. SIGUSR1 it forwards to every
  rank and then returns their status: the trainer checkpoints and exits 75. So the
  first SIGTERM becomes a SIGUSR1, and a second one, passed on, aborts.
- Hydra forwards every SIGTERM to the ranks and returns their status, but not SIGUSR1
  safely: MPICH's and Intel MPI's ``MPI_Init`` install a SIGUSR1 handler of their own
  (Hydra's failure notice), which swallows one that arrives before the rank's. So the
  preemption is a SIGTERM, and an abort is what Hydra calls one: a second SIGINT
  ("Press Ctrl-C again to force abort"), so the launcher sends two.

Hydra loses a signal that comes before its proxies are connected (MPICH's first ~10 ms,
Intel MPI's first ~0.1 s; the job then runs to its end with status 0), so until the
ranks had handlers for it when it was sent (their ``/proc`` entries), the launcher sends
the preemption again every :data:`RESEND_S` seconds: the ranks take it as one request. And a rank that
gets it before Python has run a line of its code dies of it before anything began:
Open MPI's ``mpiexec`` then exits 138, MPICH's 15 ("EXIT STRING: Terminated (signal
15)"), Intel MPI's 255 ("KILLED BY SIGNAL: 15"); after a preemption the launcher reports
those as 75 too, nothing having started. A SIGUSR1 is a preemption too (the family's signal), SIGUSR2 is
passed on as it is; SIGINT is left to ``mpiexec`` (Ctrl-C in a terminal reaches both). Otherwise the exit
status is ``mpiexec``'s::

    mpidl launch -n 4 mpidl train            # as `mpiexec -n 4 mpidl train`
    kill -TERM <its pid>                     # checkpoint, then exit 75

A preemption before ``mpiexec`` is started starts nothing and exits 75. Only the
launcher's own first milliseconds, before its handlers, are out of reach: a SIGTERM then
ends it with 143, having started nothing. Under a launcher it does not know, the first
SIGTERM is passed on as a SIGTERM and no abort is promised.

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
import time
from dataclasses import dataclass
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


EXIT_PREEMPTED = 75  # EX_TEMPFAIL, as mpidl.train.signals (hpc does not import mpidl)


@dataclass(frozen=True)
class Family:
    """How one family of ``mpiexec`` takes signals: the one table of the module's text.

    Attributes:
        name: as the messages say it.
        says: words of its ``mpiexec --version`` (any one names the family).
        preempt: the signal that asks the ranks to checkpoint and stop, through it.
        abort: the signals that end the job at once, sent in turn (empty: none known).
        died: its exit statuses when a rank died of ``preempt`` before it could catch it.
        died_says: what it then writes (a rank's death, not its own exit code), or None
            where the status alone says it.
    """

    name: str
    says: tuple[str, ...]
    preempt: signal.Signals
    abort: tuple[signal.Signals, ...]
    died: frozenset[int]
    died_says: re.Pattern[bytes] | None = None


OPEN_MPI = Family("Open MPI", ("Open MPI", "OpenRTE"), signal.SIGUSR1, (signal.SIGTERM,),
                  frozenset({128 + signal.SIGUSR1}))
# Hydra reports a rank killed by signal N with the exit status N (MPICH) or 255 (Intel
# MPI), and says so on its standard output.
MPICH = Family("MPICH", ("HYDRA",), signal.SIGTERM, (signal.SIGINT, signal.SIGINT),
               frozenset({signal.SIGTERM}),
               re.compile(rb"Terminated \(signal 15\)|KILLED BY SIGNAL: 15\b"))
INTEL_MPI = Family("Intel MPI", ("Intel(R) MPI",), signal.SIGTERM,
                   (signal.SIGINT, signal.SIGINT), frozenset({255}),
                   re.compile(rb"KILLED BY SIGNAL: 15\b"))
OTHER = Family("an unknown MPI", (), signal.SIGTERM, (), frozenset())
FAMILIES = (OPEN_MPI, INTEL_MPI, MPICH)  # Intel's Hydra is asked before MPICH's

# Launchers asked, by (resolved path, modification time): a process that launches many
# jobs (a test suite: 260 launches in tests/integration) asks each launcher once; each
# `mpiexec --version` cost 0.01-0.25 s there. A launcher replaced in place is asked again.
_FAMILY: dict[tuple[str, int], Family] = {}


def family_of(path: str) -> Family:
    """The family of the launcher at ``path`` (asks it for its version, once per launcher
    file and process); :data:`OTHER` where it says nothing known or cannot be asked."""
    found = shutil.which(path) or path
    try:
        key = (os.path.realpath(found), os.stat(found).st_mtime_ns)
    except OSError:
        return OTHER
    if key not in _FAMILY:
        try:
            out = subprocess.run([found, "--version"], capture_output=True, text=True,
                                 timeout=20, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return OTHER  # not remembered: a timeout under load is not an answer
        text = out.stdout + out.stderr
        _FAMILY[key] = next((f for f in FAMILIES if any(w in text for w in f.says)), OTHER)
    return _FAMILY[key]


def is_open_mpi(path: str) -> bool:
    """Whether the launcher at ``path`` is Open MPI's (:func:`family_of`)."""
    return family_of(path) is OPEN_MPI


# Seconds between sends of the preemption until the ranks had handlers for it when it
# was sent: mpiexec loses it before its proxies are connected (MPICH's first ~10 ms,
# Intel MPI's first ~0.1 s; MPICH once where its proxy had already been forked). Not
# after: a rank that has caught it and is ending (its handlers gone) would die of
# another. Where no rank shows on this node (ranks on other nodes only), it is sent
# again for at most RESEND_FOR_S.
RESEND_S = 0.5
RESEND_FOR_S = 10.0


def process_rank(pid: int) -> int | None:
    """The MPI rank of process ``pid``, read from its environment (``/proc``) by
    :func:`hpc.env.detect`, whatever the launcher; None for a process no launcher started
    (``mpiexec``, a proxy, a shell), one that is gone, or where ``/proc`` is not."""
    from hpc.env import detect

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
    except OSError:
        return None
    environ = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
    try:
        found = detect(environ)
    except ValueError:  # a half-written or foreign environment: not a rank
        return None
    return found.rank if found.launcher != "none" else None


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    except (OSError, StopIteration, ValueError):
        return False
    return bool(mask >> (signum - 1) & 1)


def ranks_catch(pid: int, signum: int) -> bool:
    """Whether ranks (:func:`process_rank`) run below process ``pid`` and every one of
    them has a handler for ``signum``: a signal forwarded now is caught."""
    parents: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return False
    for name in filter(str.isdigit, names):
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(parent, []).append(int(name))
    todo, ranks = list(parents.get(pid, ())), []
    while todo:
        below = todo.pop()
        if process_rank(below) is not None:
            ranks.append(below)
        else:
            todo += parents.get(below, ())
    return bool(ranks) and all(_catches(r, signum) for r in ranks)


class _Relay:
    """The launcher's signal handlers: what each signal becomes for the child. Signals
    that arrive before the child exists wait in ``pending`` (:meth:`attach` sends them)."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.family = OTHER
        self.pending: list[int] = []
        self.terms = 0
        self.preempted = False  # a preemption was (or is to be) relayed
        self.landed = False  # the ranks caught it when it was last sent
        self.first_sent: float | None = None

    def __call__(self, signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            self.terms += 1
            if self.terms == 1:
                self.preempted = True
                self._say_preempting()
                signum = -1  # the family's preemption, once it is known
            elif self.terms == 2 and self.family.abort:
                sys.stderr.write(f"mpidl launch: second SIGTERM: aborting the job "
                                 f"({'+'.join(s.name for s in self.family.abort)} to "
                                 f"{self.family.name}'s mpiexec)\n")
                sys.stderr.flush()
                signum = -2  # the family's abort
        elif signum == signal.SIGUSR1:  # a preemption too (#SBATCH --signal=USR1@120)
            self.preempted = True
            signum = -1
        if self.child is None:
            self.pending.append(signum)
            return
        self._send(signum)

    def _say_preempting(self) -> None:
        if self.child is None:
            return  # main() says it, or the family's message follows in attach()
        how = (f"; send SIGTERM again to abort" if self.family.abort else
               "; a second SIGTERM is passed on as it is")
        sys.stderr.write(f"mpidl launch: SIGTERM: asking the ranks to checkpoint and stop "
                         f"({self.family.preempt.name} to {self.family.name}'s mpiexec)"
                         f"{how}\n")
        sys.stderr.flush()

    def _send(self, signum: int) -> None:
        if signum == -1:
            signals: tuple[int, ...] = (self.family.preempt,)
            self.landed = self.landed or ranks_catch(self.child.pid, self.family.preempt)
            if self.first_sent is None:
                self.first_sent = time.monotonic()

        elif signum == -2:
            signals = self.family.abort
        else:
            signals = (signum,)
        for i, s in enumerate(signals):
            if i:
                time.sleep(0.05)  # Hydra counts a second Ctrl-C only after the first
            try:
                self.child.send_signal(s)
            except ProcessLookupError:  # it has just ended
                return

    def attach(self, child: subprocess.Popen, family: Family) -> None:
        """From now on signals go to ``child``; those that came while it started, too."""
        self.family = family
        self.child = child
        if -1 in self.pending:
            self._say_preempting()
        while self.pending:
            self._send(self.pending.pop(0))

    def resend(self) -> None:
        """The preemption once more where it may have been lost: no rank was up when it
        was last sent, and no abort was asked (see :data:`RESEND_S`)."""
        if (self.preempted and not self.landed and self.terms < 2 and self.child is not None
                and self.first_sent is not None
                and time.monotonic() - self.first_sent < RESEND_FOR_S):
            self._send(-1)


# What Open MPI's mpiexec writes when a node's daemon is gone, and when a rank aborted.
LOST_DAEMON = b"lost communication with a remote daemon"
ABORT_CODE = re.compile(rb"MPI_ABORT was invoked.*?Errorcode: (\d+)", re.S)
# How long the launcher waits, after mpiexec ended, for the rest of its standard error: a
# daemon cut off from it may hold the pipe open for ever (tests/cluster/cluster.sh reap).
TAIL_WAIT_S = 5.0


class _Errors:
    """Copies one of mpiexec's streams to ours as it comes, and keeps what a lost daemon
    and an abort said (the lines that follow them are kept, to find the error code), and
    whether it said that a rank died of the preemption (``died_says``)."""

    def __init__(self, stream: IO[bytes], to: IO[str],
                 died_says: re.Pattern[bytes] | None = None) -> None:
        self.seen = bytearray()
        self.lost = False
        self.died = False
        self._died_says = died_says
        self._thread = threading.Thread(target=self._copy, args=(stream, to), daemon=True)
        self._thread.start()

    def _copy(self, stream: IO[bytes], to: IO[str]) -> None:
        out = to.buffer if hasattr(to, "buffer") else None
        for line in iter(stream.readline, b""):
            if out is not None:
                out.write(line)
                out.flush()
            else:  # pragma: no cover - a stream without bytes (an embedding)
                to.write(line.decode(errors="replace"))
            self.died = self.died or bool(self._died_says and self._died_says.search(line))
            self.lost = self.lost or LOST_DAEMON in line
            if b"MPI_ABORT was invoked" in line or (self.seen and len(self.seen) < 4096):
                self.seen += line

    def join(self) -> None:
        """Wait for the stream's last lines (at most :data:`TAIL_WAIT_S` seconds)."""
        self._thread.join(TAIL_WAIT_S)

    def status(self, code: int) -> int:
        """mpiexec's status, or the abort's (1 if none) where it lost a daemon and said 0."""
        self.join()
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
        family = family_of(command[0])
        if relay.preempted:
            print(f"mpidl launch: preempted before mpiexec started: nothing started; exiting "
                  f"with {EXIT_PREEMPTED} (run it again)", file=sys.stderr, flush=True)
            return EXIT_PREEMPTED
        # Both streams through us: Hydra says on its standard output how a rank died.
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except (FileNotFoundError, PermissionError) as e:
        print(f"mpidl launch: error: cannot run the launcher: {e}", file=sys.stderr)
        return 2
    relay.attach(child, family)  # and sends what came since the check above
    said = _Errors(child.stdout, sys.stdout, family.died_says)
    errors = _Errors(child.stderr, sys.stderr, family.died_says)
    # Not before the start: mpiexec would inherit an ignored SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            code = child.wait(timeout=RESEND_S)
            break
        except subprocess.TimeoutExpired:
            relay.resend()  # a preemption that came before mpiexec's proxies is lost
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
    said.join()
    status = errors.status(code if code >= 0 else 128 - code)  # killed: the shell's way
    if not relay.preempted:
        return status
    if status == 128 + family.preempt or (
            status in family.died and (family.died_says is None or said.died or errors.died)):
        print(f"mpidl launch: the job ended by the {family.preempt.name} that asked it to "
              "stop, before a rank (or mpiexec) could catch it: it was starting and had done "
              f"nothing yet; exiting with {EXIT_PREEMPTED} (preempted: run it again)",
              file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    if status == 0:
        print("mpidl launch: the job ended with 0 although it was asked to stop: it had "
              "finished before the request reached a rank", file=sys.stderr, flush=True)
    return status
