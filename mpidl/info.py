"""``mpidl info``: what this job sees — MPI, ranks, nodes, GPUs, libraries, Slurm job.

Run it the way the training will run, so it answers "is my launch right?"::

    mpidl info                          # one process
    mpiexec -n 4 mpidl info             # does MPI see 4 ranks, on how many nodes?
    srun --mpi=pmix mpidl info --json   # machine-readable, for a job log

Every rank gathers its own facts (host, local rank, threads, GPU binding); rank 0
prints one report. The report always has a line ``ranks: N`` with the size of the
world communicator: if it says 1 under a launcher that started N processes, MPI was
not initialised across them (for example ``srun --mpi=pmi2`` with an MPI built for
PMIx only) and every process is a singleton.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import socket
import subprocess
import sys
from collections import Counter
from typing import Any, Sequence

# Per-rank lines in the text report; beyond this only the summary (JSON has all).
MAX_RANK_LINES = 64


def _version(module: str) -> str | None:
    """``module.__version__`` if it imports, else None."""
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:  # not installed, or cupy failing on a machine without CUDA
        return None


def _mpi_versions() -> dict[str, Any]:
    """MPI library (first line) and standard version, without initialising MPI here.

    If this process has not imported mpi4py (a size-1 world), a child reads them with
    ``rc.initialize = False``: a singleton ``MPI_Init`` is not needed to say which MPI.
    """
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None:
        # Open MPI ends the string with a NUL byte; strip it with the whitespace.
        return {"library": MPI.Get_library_version().splitlines()[0].strip("\x00 \t"),
                "standard": "%d.%d" % MPI.Get_version()}
    code = ("import json, mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(json.dumps({'library': MPI.Get_library_version().splitlines()[0]"
            ".strip(chr(0) + ' '), "
            "'standard': '%d.%d' % MPI.Get_version()}))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:
        return {"library": None, "standard": None}


# OpenBLAS's kernels that use AVX-512 (its DYNAMIC_ARCH names, as threadpoolctl reports them).
_AVX512_KERNELS = {"skylakex", "cooperlake", "sapphirerapids"}


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def blas_kernel_hint(kernel: str | None, flags: set[str], forced: str | None) -> str | None:
    """Why NumPy's GEMMs may run below what the CPU can do, or None.

    Some images set ``OPENBLAS_CORETYPE=Haswell`` for processors that older OpenBLAS
    builds mishandle; a current one then still runs its AVX2 kernels on an AVX-512 CPU.
    Measured on a 2-core AMD EPYC with AVX-512 (2026-12-02, one thread): float32
    1024-square matmul 116 GFLOP/s with the Haswell kernels against 215 with SkylakeX,
    and the cnn's 14x14 convolution 16.3 against 11.0 ms per forward + backward.
    """
    if not kernel or "avx512f" not in flags or kernel.lower() in _AVX512_KERNELS:
        return None
    why = f"OPENBLAS_CORETYPE={forced} is set" if forced else "as OpenBLAS chose"
    return (f"OpenBLAS runs its {kernel} kernels on a CPU with AVX-512 ({why}); matrix "
            f"products may run up to ~2x slower than the CPU allows. Unless this OpenBLAS "
            f"is known to fail on this CPU, run without OPENBLAS_CORETYPE (and "
            f"OPENBLAS_L2_SIZE) and check the kernel again with `mpidl info`")


def _blas() -> list[dict[str, Any]]:
    """The BLAS libraries NumPy uses: threadpoolctl's view if installed, else NumPy's build."""
    import numpy  # noqa: F401  (threadpoolctl finds only libraries already loaded)

    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        pass
    else:
        flags, forced = _cpu_flags(), os.environ.get("OPENBLAS_CORETYPE") or None
        found = []
        for p in threadpool_info():
            if p.get("user_api") != "blas":
                continue
            kernel = p.get("architecture")
            found.append({"name": p.get("internal_api"), "version": p.get("version"),
                          "threading": p.get("threading_layer"),
                          "threads": p.get("num_threads"), "kernel": kernel,
                          "hint": blas_kernel_hint(kernel, flags, forced)})
        return found
    try:
        blas = numpy.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except Exception:  # NumPy < 1.26 has no mode="dicts"
        return []
    return [{"name": blas.get("name"), "version": blas.get("version"), "threading": None,
             "threads": None}]


def rank_facts(comm: Any, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """This rank's own facts (not collective); errors are recorded, never raised."""
    from hpc import env, gpu

    environ = dict(os.environ if environ is None else environ)
    facts: dict[str, Any] = {
        "rank": comm.rank, "host": socket.gethostname(), "node": env.node_name(environ),
        "pid": os.getpid(),
        "local_rank": getattr(comm, "local_rank", 0),
        "local_size": getattr(comm, "local_size", 1),
        "omp_num_threads": environ.get("OMP_NUM_THREADS"),
        # CPUs this rank may run on: a launcher's binding shows here, not in os.cpu_count()
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
        "gpus": None, "device": None, "device_name": None, "pci_bus_id": None, "error": None,
    }
    try:
        facts["gpus"] = gpu.device_count(environ)
        # As mpidl train binds: by the communicator's local rank, MPI's shared-memory
        # split (hpc.env.split_nodes), which needs no launcher variable (PALS, srun
        # without SLURM_LOCALID); a size-1 world is local rank 0.
        facts["device"] = gpu.bind(getattr(comm, "local_rank", 0), environ=environ)
        if facts["device"] is not None:
            described = gpu.describe_device(facts["device"])
            facts["device_name"] = described.get("name")
            facts["pci_bus_id"] = described.get("pci_bus_id")
    except Exception as exc:  # every rank must still reach the gather
        facts["error"] = f"{type(exc).__name__}: {exc}"
    return facts


def collect(comm: Any, probe: bool = True) -> dict[str, Any]:
    """Gather every rank's facts into one report. Collective: all ranks of ``comm`` call it.

    Returns:
        The same report dict on every rank (see ``mpidl info --json``).
    """
    from hpc import env, gpu

    per_rank = comm.allgather_obj(rank_facts(comm))
    if probe:
        try:
            verdict = gpu.cuda_aware_mpi(comm=comm)
            cuda_aware = {"aware": verdict.aware, "reason": verdict.reason,
                          "method": verdict.method, "cases": dict(verdict.cases)}
        except ValueError as exc:  # a bad MPIDL_CUDA_AWARE, raised on every rank alike
            cuda_aware = {"aware": None, "reason": str(exc), "method": None, "cases": {}}
    else:
        cuda_aware = {"aware": None, "reason": "not probed (--no-probe)", "method": None,
                      "cases": {}}
    hosts = list(dict.fromkeys(r["node"] for r in per_rank))  # in order of first rank
    counts = Counter(r["node"] for r in per_rank)
    grouping = getattr(comm, "node_grouping", None)  # None: one process, no MPI
    left = None
    if comm.rank == 0:  # squeue asks the controller: once per job, not once per rank
        try:
            left = env.time_left()
        except ValueError:  # a malformed SLURM_JOB_END_TIME; detect() below reports it
            pass
    left = comm.bcast_obj(left, root=0)
    try:
        job = env.detect()
        job_info = {"id": job.job_id, "launcher": job.launcher, "seconds_left": left,
                    "nodes": os.environ.get("SLURM_JOB_NUM_NODES")
                    or os.environ.get("SLURM_NNODES")}
    except ValueError as exc:
        job_info = {"id": None, "launcher": None, "seconds_left": None, "nodes": None,
                    "error": str(exc)}
    import mpidl

    versions = {name: _version(name) for name in ("numpy", "cupy", "h5py", "mpi4py")}
    versions["hdf5"] = _hdf5_version()
    return {
        "mpidl": mpidl.__version__,
        "python": platform.python_version(),
        "mpi": {**_mpi_versions(), "in_use": getattr(comm, "mpi_comm", None) is not None},
        "ranks": comm.size,
        "nodes": len(hosts),
        "ranks_per_node": {h: counts[h] for h in hosts},
        # how mpidl found the nodes (hpc.env.group_nodes): MPI's shared-memory split, or
        # the node names where the split disagreed with them
        "nodes_found_by": None if grouping is None else grouping.by,
        "nodes_note": None if grouping is None else grouping.reason,
        "job": job_info,
        "cuda_aware": cuda_aware,
        "versions": versions,
        "blas": _blas(),
        "per_rank": per_rank,
    }


def _hdf5_version() -> str | None:
    try:
        import h5py

        return str(h5py.version.hdf5_version)
    except Exception:
        return None


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_report(report: dict[str, Any]) -> str:
    """The text report of ``mpidl info`` (pure: a function of the report dict)."""
    mpi = report["mpi"]
    lines = [f"mpidl {report['mpidl']} on Python {report['python']}"]
    lines.append(f"MPI library: {mpi.get('library') or 'not available (pip install mpidl[mpi])'}")
    if mpi.get("standard"):
        used = "" if mpi.get("in_use") else " (not initialised: no MPI launcher)"
        lines.append(f"MPI standard: {mpi['standard']}{used}")
    lines.append(f"ranks: {report['ranks']}")
    lines.append(f"nodes: {report['nodes']}")
    per_node = report["ranks_per_node"]
    lines.append("ranks per node: " + ", ".join(f"{h}={n}" for h, n in per_node.items()))
    lines.append("hosts: " + " ".join(per_node))
    if report.get("nodes_found_by") == "shared memory":
        lines.append("nodes found by: MPI's shared-memory split (agrees with the node names)")
    elif report.get("nodes_found_by"):
        lines.append(f"nodes found by: node name ({report['nodes_note']})")
    job = report["job"]
    if job.get("error"):
        lines.append(f"job: cannot read the launcher variables: {job['error']}")
    elif job.get("id"):
        left = "unknown" if job["seconds_left"] is None else _duration(job["seconds_left"])
        lines.append(f"slurm job: {job['id']}, nodes {job.get('nodes') or '?'}, "
                     f"time left {left}, launcher {job['launcher']}")
    else:
        lines.append(f"slurm job: none (launcher {job.get('launcher')})")
    first = report["per_rank"][0]
    threads = sorted({r["omp_num_threads"] or "unset" for r in report["per_rank"]})
    lines.append(f"threads per rank: OMP_NUM_THREADS={'/'.join(threads)} "
                 f"(rank 0 may use {first['cpus']} CPUs)")
    for b in report["blas"]:
        extra = f", {b['threading']} threading, {b['threads']} threads" if b["threads"] else ""
        kernel = f", {b['kernel']} kernels" if b.get("kernel") else ""
        lines.append(f"BLAS: {b['name']} {b['version']}{extra}{kernel}")
        if b.get("hint"):
            lines.append(f"  note: {b['hint']}")
    versions = report["versions"]
    lines.append("versions: " + ", ".join(f"{k} {v or '-'}" for k, v in versions.items()))
    ca = report["cuda_aware"]
    answer = {True: "yes", False: "no", None: "unknown"}[ca["aware"]]
    lines.append(f"CUDA-aware MPI: {answer} ({ca['reason']})")
    for case, result in (ca.get("cases") or {}).items():  # what each device-buffer test gave
        lines.append(f"  {case}: {result}")
    gpus = [r for r in report["per_rank"] if r["device"] is not None]
    lines.append(f"GPUs: {len(gpus)} of {report['ranks']} ranks bound to a device"
                 if gpus else "GPUs: none visible (no CuPy/CUDA device, or none allocated)")
    for r in report["per_rank"][:MAX_RANK_LINES]:
        dev = "no device" if r["device"] is None else \
            f"device {r['device']}" + (f" {r['device_name']} [{r['pci_bus_id']}]"
                                       if r["device_name"] else "")
        where = r["host"] if r.get("node", r["host"]) == r["host"] else \
            f"{r['node']} (host {r['host']})"
        line = (f"  rank {r['rank']} on {where}: local {r['local_rank']}/"
                f"{r['local_size']}, {dev}, CUDA_VISIBLE_DEVICES="
                f"{'unset' if r['cuda_visible_devices'] is None else r['cuda_visible_devices']}, "
                f"pid {r['pid']}")
        lines.append(line + (f", error: {r['error']}" if r["error"] else ""))
    if len(report["per_rank"]) > MAX_RANK_LINES:
        lines.append(f"  ... {len(report['per_rank']) - MAX_RANK_LINES} more ranks (see --json)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``mpidl info [--json] [--no-probe]``; rank 0 prints, every rank returns 0."""
    parser = argparse.ArgumentParser(prog="mpidl info", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-probe", action="store_true",
                        help="skip the CUDA-aware-MPI probe (a child process on GPU machines)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from mpidl.comm import world

    comm = world()
    report = collect(comm, probe=not args.no_probe)
    if comm.rank == 0:
        print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    return 0
