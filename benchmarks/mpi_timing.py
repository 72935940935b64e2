"""Shared timing helpers of the MPI benchmarks (``gradsync.py``, ``dp_train.py``).

Protocol (``/work/shared/research/performance.md``): a warm-up, then several timed
windows; every rank runs the same number of iterations in a window (the count is
calibrated on rank 0 and broadcast, so collectives always match) and a window's time is
the **maximum over ranks**. Results are reported as min / median / max over windows.
"""
from __future__ import annotations

import os

# Before numpy/torch create their thread pools: one thread per rank, as the protocol says.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

# ``--malloc keep`` (engine.py, dp_train.py): glibc returns the top of the heap to the
# kernel when more than M_TRIM_THRESHOLD is free, which at the end of every training
# step (all activations freed) hands back the step's memory, and the next step
# page-faults it in again: 13,900 faults and 44 ms of kernel time per transformer step
# for mpidl (of ~250 ms), 5,000 and 11 ms for PyTorch. Never trimming, and serving
# blocks up to 32 MiB (glibc's largest) from the heap, removes that for both. The same
# variables work for any long-running training process (``mpidl train`` sets the same
# policy itself, see ``mpidl.backend.keep_freed_memory``); the engines' code is the same.
MALLOC_KEEP = {"MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_MMAP_THRESHOLD_": str(1 << 25)}

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def limit_threads() -> None:
    """One BLAS/OpenMP thread in this process (threadpoolctl, when installed)."""
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=1)
    except ImportError:
        pass


def stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "n": len(values)}


def machine() -> dict:
    """Noise indicators: load average now and CPU idle share over the last 0.3 s."""
    def idle() -> tuple[float, float]:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)

    try:
        i0, t0 = idle()
        time.sleep(0.3)
        i1, t1 = idle()
        return {"loadavg": os.getloadavg()[0], "cpu_idle_frac_pre": (i1 - i0) / max(t1 - t0, 1)}
    except OSError:
        return {}


def timed_windows(mpi_comm: Any, step: Callable[[], None], window_s: float, windows: int,
                  warmup_s: float, prepare: Callable[[], None] | None = None) -> list[float]:
    """Seconds per ``step`` for each timed window, the slowest rank's, on every rank.

    Collective over ``mpi_comm`` (an mpi4py communicator). ``step`` may itself be
    collective: every rank runs it the same number of times. With ``prepare``, every
    ``step`` is preceded by ``prepare()`` and a barrier, both outside the timed time:
    ``step`` is timed alone, each call from aligned ranks.
    """
    from mpi4py import MPI

    def run(count: int) -> float:
        if prepare is None:
            t0 = time.perf_counter()
            for _ in range(count):
                step()
            return time.perf_counter() - t0
        spent = 0.0
        for _ in range(count):
            prepare()
            mpi_comm.Barrier()
            t0 = time.perf_counter()
            step()
            spent += time.perf_counter() - t0
        return spent

    t_end = time.perf_counter() + warmup_s
    n, done = 0, False
    while not done:  # rank 0 decides when the warm-up ends: equal step counts everywhere
        run(1)
        n += 1
        done = mpi_comm.bcast(n >= 3 and time.perf_counter() >= t_end, root=0)
    per_step = mpi_comm.allreduce(run(2) / 2, op=MPI.MAX)
    count = max(1, int(round(window_s / max(per_step, 1e-9))))
    out = []
    for _ in range(windows):
        mpi_comm.Barrier()
        out.append(mpi_comm.allreduce(run(count), op=MPI.MAX) / count)
    return out


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
