"""End-to-end check of the GPU path on a GPU machine: binding, probe, device buffers in MPI,
and the host synchronisations of a training step.

Run on the machine (and under the launcher) that training will use::

    python -m hpc.gpu_check                       # one process
    mpiexec -n 2 python -m hpc.gpu_check          # ranks share or split the GPUs
    srun --mpi=pmix --gpus-per-task=1 python -m hpc.gpu_check --require-gpu

Every rank runs every check; rank 0 prints one line per check (``ok``, ``FAIL`` or
``skip``), naming the ranks that failed, then a summary line. The exit status is 1 on
every rank if any check failed on any rank. Without CuPy or a GPU it prints why and
exits 0, unless ``--require-gpu`` makes that a failure (exit 1).

The probe's cases (blocking sendrecv and allreduce, a non-blocking allreduce, the
node-local exchange) are printed one per line. The last checks count how often the
host waits for the GPU in each phase of a small training step (``--sync-step``, by
default mpidl's ``mpidl.testing.device_step:build``, imported by name: hpc does not
depend on mpidl, and the check is skipped where mpidl is not importable). A wait is
counted where CuPy declares one (``ndarray.get``, scalar reads, ``Device.synchronize``:
``cupy._core.syncdetect``) and at every ``Stream.synchronize``/``Event.synchronize``,
with the line of the caller; a phase that the step module expects to be free of waits
(``EXPECTED_SYNCS``) fails if it has any, and a phase with a budget fails above it: the
default module's ``"budget step"`` is a step of ``mpidl train gpt --backend=cupy``, held
to docs/testing.md's device budget (host reads; the module's ``judged`` leaves out the
exchange's waits), the same budget tests/unit/test_device_budgets.py holds on the fake
device.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
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

    def run(self, name: str, check: Callable[[], str]) -> bool:
        """Run ``check`` (returns a detail, raises on failure) and print the verdict line.

        Returns True when it passed on every rank.
        """
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
        return not bad

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


class SyncCounter:
    """Counts the host's waits for the GPU inside a ``with`` block, by call site.

    Wraps ``cupy._core.syncdetect._declare_synchronize`` (called by ``ndarray.get``,
    hence by every device-to-host read, and by ``Device.synchronize``) and the
    ``synchronize`` methods of CuPy's stream and event classes (Python classes, so they
    can be wrapped). A ``get`` declares its wait and then synchronises its stream: that
    is one wait, counted once (a stream sync right after a declared wait is not counted;
    had it been another, it would have found the stream idle). Not seen: waits inside
    other libraries (an MPI library synchronising on its own), and implicit ones CuPy
    does not declare.

    Attributes:
        sites: one ``"file:line in function"`` (the first caller outside CuPy and this
            module) per wait, in order.
    """

    def __init__(self, cp: Any) -> None:
        self._cp = cp
        self.sites: list[str] = []
        self._declared = False  # a declared wait whose stream sync has not come yet
        self._undo: list[tuple[Any, str, Any]] = []

    def _site(self) -> str:
        frame = sys._getframe(2)
        here = os.path.abspath(__file__)
        while frame is not None:
            path = frame.f_code.co_filename
            # CuPy's frames, and a stand-in's for it (a module that sets CUPY_STAND_IN,
            # as mpidl.testing.fakedevice does), are not the caller.
            inside = f"{os.sep}cupy{os.sep}" in path or frame.f_globals.get("CUPY_STAND_IN")
            if os.path.abspath(path) != here and not inside:
                parts = path.split(os.sep)
                return f"{os.sep.join(parts[-2:])}:{frame.f_lineno} in {frame.f_code.co_name}"
            frame = frame.f_back
        return "?"

    def _wrap(self, owner: Any, name: str, declares: bool) -> None:
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        counter = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            site = counter._site()
            if declares:
                counter.sites.append(site)
                counter._declared = True
            elif counter._declared:  # the stream sync of the get() that just declared
                counter._declared = False
            else:
                counter.sites.append(site)
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._undo.append((owner, name, original))

    def __enter__(self) -> "SyncCounter":
        cp = self._cp
        try:
            syncdetect = importlib.import_module(f"{cp.__name__}._core.syncdetect")
        except ImportError:
            syncdetect = None
        if syncdetect is not None and hasattr(syncdetect, "_declare_synchronize"):
            self._wrap(syncdetect, "_declare_synchronize", declares=True)
        stream_type = type(cp.cuda.get_current_stream())
        for cls in (stream_type, cp.cuda.Event):
            if not isinstance(cls, type):
                continue
            owner = next((c for c in cls.__mro__ if "synchronize" in c.__dict__), None)
            if owner is not None and all(o is not owner for o, _, _ in self._undo):
                try:
                    self._wrap(owner, "synchronize", declares=False)
                except (TypeError, AttributeError):  # a C type in some CuPy version
                    pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def summary(self, steps: int) -> str:
        """``"1.5 per step (a.py:10 in f x2, b.py:7 in g x1)"`` over ``steps`` steps."""
        counts = collections.Counter(self.sites)
        where = ", ".join(f"{site} x{n}" for site, n in counts.most_common(6))
        return f"{len(self.sites) / max(steps, 1):g} per step" + (f" ({where})" if where else "")


def _sync_checks(checks: _Checks, cp: Any, spec: str, steps: int) -> None:
    """Count the host's waits per call of each phase of the step module ``spec``."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        why = checks.gather(f"{module_name} does not import ({exc})")
    else:
        why = checks.gather("")
    if any(why):  # the same verdict on every rank: all skip together
        checks.say(f"skip host syncs: {next(w for w in why if w)}")
        return
    phases: dict = {}
    expected = getattr(module, "EXPECTED_SYNCS", {})
    if not checks.run(f"sync step build ({spec})",
                      lambda: str(phases.update(getattr(module, attr or "build")()) or
                                  f"phases {', '.join(phases)}")):
        return
    for name, phase in phases.items():
        def count(phase: Callable[[], None] = phase, name: str = name) -> str:
            for _ in range(2):  # warm-up: kernels compiled, pools and buffers allocated
                phase()
            with SyncCounter(cp) as counter:
                for _ in range(steps):
                    phase()
            limit = expected.get(name)
            result = counter.summary(steps)
            # A module's judged(sites) leaves out the waits its budget does not count.
            counted = len(getattr(module, "judged", list)(counter.sites))
            _expect(limit is None or counted <= limit * steps,
                    f"{result}; {counted / steps:g} per step judged, expected at most {limit}")
            return result + ("" if limit is None else f"; at most {limit} expected")

        checks.run(f"host syncs ({name})", count)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--require-gpu", action="store_true",
                        help="no GPU is a failure, not a skip")
    parser.add_argument("--no-cache", action="store_true", help="re-run the CUDA-aware probe")
    parser.add_argument("--timeout", type=float, default=60, help="seconds for the probe child")
    parser.add_argument("--sync-step", default="mpidl.testing.device_step:build",
                        help="MODULE:FUNCTION returning the phases of a training step whose "
                             "host synchronisations are counted ('' to skip)")
    parser.add_argument("--sync-steps", type=int, default=5,
                        help="calls of each phase counted (after two warm-up calls)")
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
    for case, result in verdict.cases.items():
        checks.say(f"info probe case {case}: {result}")
    if comm is None:
        if args.sync_step:
            _sync_checks(checks, cp, args.sync_step, args.sync_steps)
        return _summary(checks)
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

    def staged_iallreduce() -> str:
        # What mpidl does for every non-blocking reduction of a device buffer (Open
        # MPI's non-blocking reductions cannot take device pointers): a pinned host copy.
        x = cp.full(1 << 16, checks.rank + 1, dtype=cp.float32)
        host = cp.cuda.alloc_pinned_memory(x.nbytes)
        import numpy

        pinned = numpy.frombuffer(host, dtype=numpy.float32, count=x.size)
        x.get(out=pinned)
        comm.Iallreduce(MPI.IN_PLACE, pinned, op=MPI.SUM).Wait()
        x.set(pinned)
        _expect(bool((x == expected).all()), f"got {float(x[0])}, expected {expected}")
        return f"pinned-host Iallreduce of a CuPy array = {expected:g} on every element"

    checks.run("staged iallreduce", staged_iallreduce)

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
    if args.sync_step:
        _sync_checks(checks, cp, args.sync_step, args.sync_steps)
    return _summary(checks)


def _summary(checks: _Checks) -> int:
    checks.say("summary: " + ("FAILED (see the FAIL lines)" if checks.failed else "all checks ok"))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
