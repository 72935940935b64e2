"""Launch a command on k MPI ranks from a test, with a wall-clock limit.

A hang must become a failure, never a stuck CI: every launch has a timeout, after which
the whole process group is stopped (SIGTERM, then SIGKILL) and :class:`LaunchTimeout`
says what was running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from hpc.launch import is_open_mpi, mpiexec_path


class LaunchTimeout(AssertionError):
    """The launched job did not finish within its wall-clock limit."""


@dataclass
class Launched:
    """Outcome of :func:`mpiexec`: exit status, output, and seconds taken."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


# Seconds a timed-out job gets to end on SIGTERM before the SIGKILL: Open MPI's mpiexec
# removes its session directory (/tmp/ompi.<pid>) on SIGTERM, and a SIGKILL leaves it
# behind (seen: one per hang test of a suite run).
STOP_GRACE_S = 5.0


def _stop_group(proc: subprocess.Popen) -> tuple[str, str]:
    """End ``proc``'s process group: SIGCONT (a stopped rank must see the rest) and
    SIGTERM, then SIGKILL whatever is left after :data:`STOP_GRACE_S`; its output."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # already gone
            break
    try:
        return proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc.communicate()


def mpiexec_command(n: int, args: Sequence[str]) -> list[str]:
    """The command line that runs ``args`` on ``n`` ranks with this machine's launcher."""
    cmd = [mpiexec_path(), "-n", str(n)]
    if is_open_mpi(cmd[0]):
        # CI machines may report fewer slots than ranks; oversubscribing is what we want.
        cmd += ["--oversubscribe"]
    return cmd + list(args)


def launch_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a launched job: one thread per rank, root allowed."""
    env = dict(os.environ)
    # Open MPI refuses to run as root (CI containers) without both of these.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run(cmd: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
        cwd: str | None = None, input: str | None = None) -> Launched:
    """Run ``cmd`` in its own process group; kill the group after ``timeout`` seconds.
    ``input``, if given, is its standard input (else it inherits this process's)."""
    import time

    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=None if input is None else subprocess.PIPE,
                            text=True, env=dict(env or launch_env()), cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _stop_group(proc)
        raise LaunchTimeout(
            f"{' '.join(cmd)} did not finish in {timeout:.0f} s (killed).\n"
            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}") from None
    return Launched(proc.returncode, out, err, time.monotonic() - t0)


# Open MPI's launcher now and then fails before it starts any rank: once in a CI run of
# the whole suite (stop 22), `prterun` printed "The PMIx server's listener thread failed
# to start" and exited 213 after 15 ms. Nothing of the test ran, so such a launch is
# tried again; every other outcome, a failure of the job included, is returned as it is.
LAUNCHER_STARTUP_FAILURES = ("The PMIx server's listener thread failed to start",)
STARTUP_RETRIES = 2


def launcher_failed_to_start(result: Launched) -> bool:
    """Whether ``result`` is the launcher's own startup failure: non-zero, nothing on
    stdout (no rank ran), and one of :data:`LAUNCHER_STARTUP_FAILURES` on stderr."""
    return (result.returncode != 0 and not result.stdout
            and any(s in result.stderr for s in LAUNCHER_STARTUP_FAILURES))


def retry_startup(launch: Callable[[], Launched], retries: int = STARTUP_RETRIES) -> Launched:
    """``launch()``, again up to ``retries`` times while the launcher fails to start."""
    result = launch()
    for _ in range(retries):
        if not launcher_failed_to_start(result):
            break
        said = next(s for s in LAUNCHER_STARTUP_FAILURES if s in result.stderr)
        print(f"mpidl.testing.launch: the launcher failed to start (exit {result.returncode}: "
              f"{said}); launching again", file=sys.stderr)
        result = launch()
    return result


def mpiexec(n: int, args: Sequence[str], timeout: float = 120,
            env: Mapping[str, str] | None = None, cwd: str | None = None) -> Launched:
    """Run ``args`` (e.g. ``[sys.executable, "-m", "mpidl", ...]``) on ``n`` ranks; a
    launch that fails in the launcher's own startup is retried (:func:`retry_startup`)."""
    cmd, full_env = mpiexec_command(n, args), launch_env(env)
    return retry_startup(lambda: run(cmd, timeout, full_env, cwd))


def start(cmd: Sequence[str], env: Mapping[str, str] | None = None,
          settle: float = 1.0) -> subprocess.Popen:
    """Start ``cmd`` (a launch a test will signal) in its own process group, with piped
    text output, and return it running. A launch that ends within ``settle`` seconds in
    the launcher's own startup failure (:func:`launcher_failed_to_start`) is started
    again, up to :data:`STARTUP_RETRIES` times; one that ends then for another reason
    is an AssertionError with its output (the test wanted a running job)."""
    for attempt in range(STARTUP_RETRIES + 1):
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(env or launch_env()),
                                start_new_session=True)
        try:
            proc.wait(timeout=settle)
        except subprocess.TimeoutExpired:
            return proc
        out, err = proc.communicate()
        if not launcher_failed_to_start(Launched(proc.returncode, out, err, 0.0)):
            break
    raise AssertionError(f"{' '.join(cmd)} ended at once (exit {proc.returncode}) after "
                         f"{attempt + 1} launch(es):\n{out[-4000:]}{err[-4000:]}")
