"""The virtual cluster of cluster.sh, driven from the tests: bring-up, launches, teardown.

The tests' cluster has names, a subnet and a state folder of its own (``mpidlt-n1`` ...,
``10.213.1.0/24``, a temporary folder), so a cluster a developer brought up by hand with
the defaults is neither used nor disturbed. Launches go through
:func:`mpidl.testing.launch.run` (a wall-clock limit; the launcher's startup failures
are retried), as every other test's do.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from mpidl.testing.launch import Launched, launch_env, retry_startup, run

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "cluster.sh"
NAME = "mpidlt"
SUBNET = "10.213.1"

# (nodes, ranks per node) -> the options of `cluster.sh mpiexec`: the hostfile gives
# every node 2 slots, filled in rank order (ranks 0-1 on n1, 2-3 on n2); one rank per
# node is mpiexec's round-robin over the nodes.
LAYOUTS = {
    (2, 2): ["--nodes", "2", "-n", "4"],
    (3, 1): ["--nodes", "3", "-n", "3", "--map-by", "node"],
    (2, 1): ["--nodes", "2", "-n", "2", "--map-by", "node"],
}


def script_env(state_dir: str | os.PathLike) -> dict[str, str]:
    """The environment cluster.sh and the launched jobs run in."""
    from hpc.launch import mpiexec_path

    return launch_env({"MPIDL_CLUSTER_DIR": str(state_dir), "MPIDL_CLUSTER_NAME": NAME,
                       "MPIDL_CLUSTER_SUBNET": SUBNET, "MPIEXEC": mpiexec_path(),
                       # `mpidl` as a command on the nodes, as a user's shell would have it
                       "PATH": os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", "")})


def script(state_dir: str | os.PathLike, *args: str, timeout: float = 120,
           check: bool = True) -> subprocess.CompletedProcess:
    """``bash cluster.sh ARGS...`` for the tests' cluster (raises on failure if check)."""
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=script_env(state_dir))
    if check and proc.returncode != 0:
        raise AssertionError(f"cluster.sh {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}{proc.stderr}")
    return proc


def unavailable() -> str | None:
    """Why namespaces cannot be made here (root, iproute2, util-linux), or None."""
    proc = subprocess.run(["bash", str(SCRIPT), "unavailable"], capture_output=True,
                          text=True, timeout=30)
    return proc.stdout.strip() or None


def leftovers() -> list[str]:
    """Namespaces and links with the tests' names that exist now (none after down)."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [f"netns {line.split()[0]}" for line in netns.splitlines()
             if line.startswith(NAME + "-")]
    found += [f"link {line.split(':')[1].strip().split('@')[0]}" for line in links.splitlines()
              if line.split(":")[1].strip().startswith(NAME + "-")]
    return found


@dataclass
class Cluster:
    """A running virtual cluster: ``nodes`` nodes with 2 slots each."""

    state_dir: Path
    nodes: int
    launches: list = field(default_factory=list)

    def command(self, layout: tuple[int, int], args: Sequence[str]) -> list[str]:
        """The command line running ``args`` at ``layout`` (nodes, ranks per node)."""
        return ["bash", str(SCRIPT), "mpiexec", *LAYOUTS[layout], *args]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**script_env(self.state_dir), **(extra or {})}

    def mpiexec(self, layout: tuple[int, int], args: Sequence[str], timeout: float = 240,
                env: dict[str, str] | None = None) -> Launched:
        """Run ``args`` on the cluster's nodes at ``layout``; see :func:`run`."""
        cmd, full_env = self.command(layout, args), self.env(env)
        result = retry_startup(lambda: run(cmd, timeout, full_env, cwd=str(HERE.parents[1])))
        self.launches.append((layout, result.seconds))
        return result

    def reap(self) -> None:
        """Stop the daemons and ranks of jobs whose mpiexec has ended (``cluster.sh reap``)."""
        script(self.state_dir, "reap")

    def link(self, node: str, state: str) -> None:
        """Cut (``down``) or mend (``up``) ``node``'s link to the bridge."""
        script(self.state_dir, "link", node, state)

    def processes(self, node: str, containing: str) -> list[int]:
        """Pids of the processes in ``node``'s namespace whose command line holds
        ``containing`` (the node's ranks, say)."""
        out = subprocess.run(["ip", "netns", "pids", f"{NAME}-{node}"], capture_output=True,
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
