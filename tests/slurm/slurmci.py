"""Submit to, poll and inspect the local single-node Slurm of tests/slurm/cluster.sh.

conftest.py's session fixture ``slurm`` starts the cluster (munged, slurmctld,
slurmd; state under ``/tmp/mpidl-slurm-ci``) and hands out a :class:`Cluster`. A
cluster that was already up (a developer's, another session's) is used and left
running; one the session started is stopped after it.

Jobs are submitted with command-line overrides for one node (command-line options win
over the templates' ``#SBATCH`` lines), get this interpreter as ``MPIDL_PYTHON`` and the
source tree on ``PYTHONPATH``, and are polled with ``squeue`` under a wall-clock limit
(``sbatch --wait`` polls too coarsely); a job over its limit is cancelled and the test
fails with the tail of its log.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SLURM_DIR = ROOT / "slurm"
CI_DIR = Path(os.environ.get("MPIDL_SLURM_CI_DIR", "/tmp/mpidl-slurm-ci"))
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")


def unavailable() -> str | None:
    """Why Slurm cannot run here, or None when it can."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing and not shutil.which("apt-get"):
        return f"Slurm is not installed ({', '.join(missing)} missing) and apt-get is absent"
    if missing and os.geteuid() != 0:
        return (f"Slurm is not installed ({', '.join(missing)} missing); install it as root "
                f"with tests/slurm/install.sh")
    if os.geteuid() != 0:
        return "the local test cluster runs its daemons as root (SlurmUser=root); run as root"
    return None


def job_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment sbatch passes on (--export=ALL): this python and source tree.

    Variables of an enclosing Slurm job are dropped, so that a CI run inside an
    allocation does not leak its job's settings into ours.
    """
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    environ["SLURM_CONF"] = str(CI_DIR / "slurm.conf")
    environ["MPIDL_PYTHON"] = sys.executable
    environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    environ.update(extra or {})
    return environ


# Seconds a requeued job waits for its hold-off before the test releases it.
HOLDOFF_RELEASE_DELAY_S = 5.0


@dataclass
class Job:
    """A finished (or still pending) job as ``scontrol show job`` describes it."""

    job_id: str
    fields: dict[str, str]
    log: Path | None

    @property
    def state(self) -> str:
        return self.fields.get("JobState", "UNKNOWN")

    @property
    def exit_code(self) -> str:
        return self.fields.get("ExitCode", "?")

    @property
    def restarts(self) -> int:
        return int(self.fields.get("Restarts", "0"))

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def describe(self, lines: int = 60) -> str:
        tail = "\n".join(self.output().splitlines()[-lines:])
        return (f"job {self.job_id}: {self.state} exit {self.exit_code} restarts {self.restarts}"
                f" reason {self.fields.get('Reason')}\n--- log {self.log} (tail) ---\n{tail}")


class Cluster:
    """Submit to, poll and inspect the local cluster."""

    def __init__(self, conf: Path, extra: Mapping[str, str] | None = None):
        """``extra``: variables every command and job gets besides :func:`job_environ`'s
        (tests/cluster's Slurm on virtual nodes: its SLURM_CONF, Open MPI's subnet)."""
        self.conf = conf
        self.extra = {"SLURM_CONF": str(conf), **(extra or {})}
        self.env = job_environ(self.extra)
        self._logs: dict[str, Path] = {}

    def run(self, *cmd: str, timeout: float = 30, check: bool = True,
            env: Mapping[str, str] | None = None, cwd: Path | None = None
            ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster."""
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              env=dict(env or self.env), cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}: "
                                 f"{proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def submit(self, script: Path | str, *options: str, args: Sequence[str] = (),
               log: Path, cwd: Path = ROOT, env: Mapping[str, str] | None = None) -> str:
        """``sbatch --parsable --output=LOG OPTIONS SCRIPT ARGS``; returns the job id.

        ``LOG`` may contain ``%j`` (the job id), Slurm's only pattern used here.

        The log's folder is created first: Slurm does not create it, and a job whose
        output cannot be opened fails without a word.
        """
        log.parent.mkdir(parents=True, exist_ok=True)
        proc = self.run("sbatch", "--parsable", f"--output={log}", *options, str(script),
                        *args, env=job_environ({**self.extra, **(env or {})}), cwd=cwd)
        job_id = proc.stdout.strip().split(";")[0]
        assert job_id.isdigit(), f"sbatch printed {proc.stdout!r}, not a job id"
        self._logs[job_id] = Path(str(log).replace("%j", job_id))
        return job_id

    def show(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (jobs are kept MinJobAge=300 s after they end)."""
        proc = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        fields: dict[str, str] = {}
        # One line of KEY=VALUE pairs; values have no spaces except Command/WorkDir paths
        # with spaces, which we do not use.
        for m in re.finditer(r"(\w+(?:/\w+)?)=(\S*)", proc.stdout):
            fields.setdefault(m.group(1), m.group(2))
        return fields

    def queue_state(self, job_id: str) -> tuple[str, str] | None:
        """(state, reason) while the job is in the queue, None once it has left."""
        proc = self.run("squeue", "-h", "-j", job_id, "-o", "%T %r", check=False)
        if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
            # slurmctld busy or restarting: not an answer, ask again.
            return ("UNKNOWN", proc.stderr.strip())
        words = proc.stdout.split()
        return (words[0], words[1] if len(words) > 1 else "") if words else None

    def _between_attempts(self, job_id: str) -> bool:
        """True if a job absent from squeue is being requeued rather than finished.

        Right after ``scontrol requeue`` the job can drop out of squeue for a moment
        while scontrol already reports it as requeued or pending again.
        """
        state = self.show(job_id).get("JobState", "")
        return state in ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RUNNING",
                         "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED")

    def release_holdoff(self, job_id: str) -> None:
        """Start a requeued job now: Slurm otherwise holds it about two minutes."""
        self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)

    def wait(self, job_id: str, limit: float,
             on_poll: Callable[[tuple[str, str]], None] | None = None) -> Job:
        """Poll until the job leaves the queue; cancel it and fail after ``limit`` seconds.

        A requeued job pending for ``BeginTime`` is released after
        ``HOLDOFF_RELEASE_DELAY_S`` instead of Slurm's two minutes. ``on_poll`` sees
        every (state, reason) while the job is queued.
        """
        deadline = time.monotonic() + limit
        held_since = None
        while (state := self.queue_state(job_id)) is not None or self._between_attempts(job_id):
            if state is None:  # a requeue in progress: not finished, look again
                time.sleep(0.25)
                continue
            if on_poll is not None:
                on_poll(state)
            if state == ("PENDING", "BeginTime"):
                # Not at once: slurmd revokes the previous attempt's credential while it
                # cleans up, and an attempt started within that window is killed as
                # "non-startable batch job: Job credential revoked" (seen here).
                held_since = held_since or time.monotonic()
                if time.monotonic() - held_since > HOLDOFF_RELEASE_DELAY_S:
                    self.release_holdoff(job_id)
            else:
                held_since = None
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False)
                job = Job(job_id, self.show(job_id), self._logs.get(job_id))
                pytest.fail(f"job {job_id} still {state} after {limit:.0f} s; cancelled.\n"
                            f"{job.describe()}")
            time.sleep(0.25)
        return Job(job_id, self.show(job_id), self._logs.get(job_id))

    def assert_completed(self, job: Job) -> None:
        assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()
