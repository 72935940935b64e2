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

Under Slurm, ``srun`` forwards SIGTERM to the tasks and returns their status, so
``srun mpidl train`` needs no wrapper.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Sequence


def mpiexec_path() -> str:
    """The ``mpiexec`` next to this Python (the Open MPI wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError(
            "no mpiexec found next to the Python interpreter or on PATH; install the "
            "Open MPI wheel with `pip install mpidl[mpi]` or load your site's MPI module")
    return found


def is_open_mpi(path: str) -> bool:
    """Whether the launcher at ``path`` is Open MPI's (asks it for its version)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


class _Relay:
    """The launcher's signal handlers: what each signal becomes for the child."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.child = child
        self.terms = 0

    def __call__(self, signum: int, frame: object) -> None:
        if signum == signal.SIGTERM:
            self.terms += 1
            if self.terms == 1:
                sys.stderr.write("mpidl launch: SIGTERM: asking the ranks to checkpoint and "
                                 "stop (SIGUSR1 to mpiexec); send SIGTERM again to abort\n")
                sys.stderr.flush()
                signum = signal.SIGUSR1
        try:
            self.child.send_signal(signum)
        except ProcessLookupError:  # it has just ended
            pass


def main(argv: Sequence[str]) -> int:
    """``mpidl launch [--launcher=PATH] MPIEXEC_ARGUMENTS...``; returns mpiexec's status."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n", 1)[1].rstrip() + "\n\nusage: mpidl launch "
              "[--launcher=PATH] MPIEXEC_ARGUMENTS...  (default launcher: the mpiexec "
              "next to this Python, else on PATH)")
        return 0 if argv else 2
    launcher = None
    if argv[0].startswith("--launcher="):
        launcher, argv = argv[0].split("=", 1)[1], argv[1:]
    try:
        command = [launcher or mpiexec_path(), *argv]
        child = subprocess.Popen(command)
    except (FileNotFoundError, PermissionError) as e:
        print(f"mpidl launch: error: cannot run the launcher: {e}", file=sys.stderr)
        return 2
    relay = _Relay(child)
    relayed = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    previous = {s: signal.signal(s, relay) for s in relayed}
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
