"""End-to-end check of the GPU path on a GPU machine: binding, probe, device buffers in MPI.

Run on the machine (and under the launcher) that training will use::

    python -m hpc.gpu_check                       # one process
    mpiexec -n 2 python -m hpc.gpu_check          # ranks share or split the GPUs
    srun --mpi=pmix --gpus-per-task=1 python -m hpc.gpu_check --require-gpu

Every rank runs every check; rank 0 prints one line per check (``ok``, ``FAIL`` or
``skip``), naming the ranks that failed. The exit status is 1 on every rank if any
check failed on any rank. Without CuPy or a GPU it prints why and exits 0, unless
``--require-gpu`` makes that a failure (exit 1).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Sequence

from hpc import env, gpu


class _Checks:
    """Runs checks on every rank and reports them from rank 0, one line each."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = 0 if comm is None else comm.Get_rank()
        self.failed = False

    def gather(self, obj: Any) -> list:
        return [obj] if self.comm is None else self.comm.allgather(obj)

    def run(self, name: str, check: Callable[[], str]) -> None:
        """Run ``check`` (returns a detail, raises on failure) and print the verdict line."""
        try:
            result = (True, check())
        except Exception as exc:  # a failing rank must still reach the gather below
            result = (False, f"{type(exc).__name__}: {exc}")
        results = self.gather(result)
        bad = [(r, msg) for r, (ok, msg) in enumerate(results) if not ok]
        self.failed = self.failed or bool(bad)
        if self.rank == 0:
            if bad:
                detail = "; ".join(f"rank {r}: {msg}" for r, msg in bad)
                print(f"FAIL {name}: {detail}", flush=True)
            else:
                print(f"ok   {name}: {results[0][1]}", flush=True)

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--require-gpu", action="store_true",
                        help="no GPU is a failure, not a skip")
    parser.add_argument("--no-cache", action="store_true", help="re-run the CUDA-aware probe")
    parser.add_argument("--timeout", type=float, default=60, help="seconds for the probe child")
    args = parser.parse_args(argv)

    # MPI before any CUDA allocation: UCX misreads earlier device buffers (ucx#2755).
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    comm = MPI.COMM_WORLD if MPI is not None else None
    checks = _Checks(comm)
    job = env.detect()
    checks.run("env", lambda: f"rank {job.rank} of {job.size}, local {job.local_rank} of "
                              f"{job.local_size}, launcher {job.launcher}, MPI "
                              f"{'yes' if comm is not None else 'not installed'}")

    cp = gpu.cupy_module()
    why = "CuPy is not installed" if cp is None else (
        "no CUDA device is visible" if not gpu.device_count() else "")
    whys = checks.gather(why)
    missing = [r for r, w in enumerate(whys) if w]
    if missing:  # the same list on every rank, so every rank returns here
        verdict = "FAIL" if args.require_gpu else "skip"
        then = "--require-gpu was given" if args.require_gpu else "nothing to check"
        checks.say(f"{verdict} gpu: no GPU on ranks {missing} ({whys[missing[0]]}); {then}")
        return 1 if args.require_gpu or checks.failed else 0

    def bind() -> str:
        device = gpu.bind(job.local_rank)
        _expect(device is not None and cp.cuda.runtime.getDevice() == device,
                f"bind chose {device}, CuPy's current device is {cp.cuda.runtime.getDevice()}")
        d = gpu.describe_device(device)
        return (f"rank {checks.rank} -> device {device} ({d['name']}, {d['pci_bus_id']}, "
                f"{d['memory_gib']} GiB)")

    checks.run("bind", bind)

    def kernel() -> str:
        x = cp.arange(1000, dtype=cp.float64)
        total = float((x * 2).sum())
        _expect(total == 999_000.0, f"sum(2 * arange(1000)) = {total}, expected 999000")
        return "a CuPy kernel ran and returned the right sum"

    checks.run("cupy kernel", kernel)
    verdict = gpu.cuda_aware_mpi(comm=comm, timeout=args.timeout, cache=not args.no_cache)
    checks.say(f"info probe: aware={verdict.aware} by {verdict.method} ({verdict.reason})")
    if comm is None:
        return 1 if checks.failed else 0
    size = comm.Get_size()
    expected = size * (size + 1) / 2

    def staged_allreduce() -> str:
        x = cp.full(1 << 16, checks.rank + 1, dtype=cp.float32)
        host = cp.asnumpy(x)  # a copy on the host: synchronous, so no stream sync needed
        comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        x = cp.asarray(host)
        _expect(bool((x == expected).all()), f"got {float(x[0])}, expected {expected}")
        return f"host-staged Allreduce of a CuPy array = {expected:g} on every element"

    checks.run("staged allreduce", staged_allreduce)

    def device_allreduce() -> str:
        x = cp.full(1 << 16, checks.rank + 1, dtype=cp.float32)
        cp.cuda.get_current_stream().synchronize()  # MPI reads the buffer, not the stream
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        _expect(bool((x == expected).all()), f"got {float(x[0])}, expected {expected}")
        send = cp.full(1 << 16, checks.rank, dtype=cp.float64)
        recv = cp.empty_like(send)
        cp.cuda.get_current_stream().synchronize()
        comm.Sendrecv(send, dest=(checks.rank + 1) % size, recvbuf=recv,
                      source=(checks.rank - 1) % size)
        left = (checks.rank - 1) % size
        _expect(bool((recv == left).all()),
                f"ring Sendrecv got {float(recv[0])}, expected {left}")
        return "device-buffer Allreduce and Sendrecv ring gave the right values"

    if verdict.aware:
        checks.run("device allreduce", device_allreduce)
    else:
        checks.say("skip device allreduce: MPI is not CUDA-aware here; mpidl stages through host")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
