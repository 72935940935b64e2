"""Run the test suite by tiers: the core tiers (README's command), the virtual cluster,
the many-rank tier, or a quick subset.

Usage (from the repository root, in the environment mpidl is installed in)::

    python tests/run.py                  # the core tiers: unit, integration, MPI 1/2/3
    python tests/run.py --quick          # a developer's check: unit, MPI at 2 ranks
    python tests/run.py --slurm          # the local Slurm (tests/slurm) only
    python tests/run.py --cluster        # the virtual cluster (tests/cluster) only
    python tests/run.py --many           # the many-rank tier (tests/many) only, 8 and 16 ranks
    python tests/run.py --extras         # only the tests that need an extra (torch, matplotlib)
    python tests/run.py --all            # all of them (what CI runs)
    python tests/run.py --sizes 2        # only the MPI tests, at 2 ranks
    python tests/run.py --many-sizes 16  # only the many-rank tier, at 16 ranks
    python tests/run.py --mpi mpich      # the MPICH tier, in .venv-mpich (--mpi impi: Intel MPI)
    python tests/run.py --no-mpi         # only the single-process tests
    python tests/run.py -- -k sampler    # extra arguments go to every pytest

Costs on the 2-core CI machine are in docs/testing.md. Each single-process tier is its own
pytest launch with its own limit and report: tests/unit and tests/integration in
pytest-xdist workers, tests/slurm (a local Slurm) and tests/cluster (virtual nodes in
network namespaces) one test at a time; the last two skip with the reason where they
cannot run (not root, packages missing).

Each MPI size runs as ``mpiexec -n N python tests/run.py --worker ...``: every rank runs
pytest with the ``--with-mpi`` flag of pytest-mpi and writes a JUnit XML report; rank 0
prints its output, the other ranks' output goes to a log that is shown if they fail. The
many-rank tier (tests/many) runs the same way at 8 and 16 ranks, oversubscribed, and its
watchdog test in one process. ``--mpi mpich`` (``impi``) makes or reuses a second
environment with that MPI's wheel and no Open MPI (:mod:`mpienv`) and runs, in it, the
MPI tests at 2 and 3 ranks, the integration tests of signals, the watchdog and the MPI
workers, and the main job (``mpiexec -n 2 mpidl train``). The run fails if any rank of any size fails, and every
launch has a wall-clock limit, so a hang is a failure rather than a stuck CI. The suite
must leave the environment as it found it: the run also fails if, at its end,
``import mpidl`` or the ``mpidl`` console script next to this Python does not work. The
last lines give each launch's time and sum up all runs:
``suite: N passed, N failed, N skipped``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # so that `python tests/run.py` finds mpidl from a checkout too

# The single-process tiers, each its own launch with its own limit and report: a tier
# that hangs or runs long is named, and the others still report.
CORE = {"unit": ["tests/unit"],
        "integration": ["tests/integration"]}
SLURM = {"Slurm": ["tests/slurm"]}
CLUSTER = {"virtual cluster": ["tests/cluster"]}
MANY_SINGLE = {"many ranks, single process": ["tests/many"]}
# tests/unit runs in as many pytest-xdist workers as there are cores (at most 4): its
# tests share no process-wide state and start no MPI job, and on 2 cores they took
# 180 s in 2 workers against 764 s in one (2026-12-02, both with other jobs loading
# the machine). tests/integration runs in one more worker than there are cores (its
# launches spend part of their time waiting: MPI start-up, imports, the disk), with
# `--dist worksteal`: each worker starts on a contiguous share of the tests, so a
# module's tests and their module fixtures (trained runs) mostly stay on one worker,
# and an idle worker takes tests from the others. 2 cores, load ~6 from other jobs
# (2026-12-02): 328 s, against 504 s with one file per worker (`loadfile`, which waits
# on the longest file) and ~916 s one test at a time. Its tests use no fixed port,
# daemon or namespace; a test that must have the machine to itself is marked `serial`
# and runs after the others, alone. tests/slurm and tests/cluster start daemons on
# fixed ports and namespaces: one test at a time.
PARALLEL = {"unit": "load", "integration": "worksteal"}
MPI = ["tests/mpi"]
MANY = ["tests/many"]

# Open MPI 5 probes libfabric (its `ofi` byte-transfer layer) in every MPI_Init: about
# 1 s of waiting per launch on this machine, which has no fabric (`mpiexec -n 2 python
# -c "from mpi4py import MPI"`: 1.25 s, 0.25-0.3 s without it, 2026-12-02). The suite
# makes hundreds of launches; shared memory and TCP, which the tests use, stay. And a
# rank waiting in MPI yields its core: each launch thinks it has the cores to itself, but
# the integration tier runs several 2-rank jobs at once on 2 cores, where a spinning rank
# takes the core its peer needs (three 2-rank trainings side by side: 51-54 s against
# 55-58 s spinning, 2026-12-02). A value the caller set is kept.
# MPICH (mpich 5.0.2's wheel): MPIR_CVAR_POLLS_BEFORE_YIELD is the number of polls of a
# busy wait before it yields the core (default 1000; 0 never yields), so 1 yields at
# every poll; its start-up probes no fabric here (`mpiexec -n 2 python -c "from mpi4py
# import MPI"`: 0.8 s), so nothing to turn off. Intel MPI: I_MPI_WAIT_MODE=1 makes a
# waiting rank sleep in the kernel instead of polling. Each is read by its MPI only.
LAUNCH_ENV = {"OMPI_MCA_btl": "^ofi", "OMPI_MCA_mpi_yield_when_idle": "1",
              "MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "I_MPI_WAIT_MODE": "1"}

# The tier of another MPI (--mpi): what runs in its environment. The MPI tests at 2 and 3
# ranks; the integration tests whose subject is the launcher (signals at every moment,
# the watchdog's aborts, one pytest per rank); and the main job.
OTHER_MPI = {"integration": ["tests/integration/test_preemption.py",
                             "tests/integration/test_launch_signals.py",
                             "tests/integration/test_watchdog.py",
                             "tests/integration/test_run_workers.py"]}
OTHER_MPI_SIZES = [2, 3]
MAIN_JOB_TIMEOUT_S = 900


@contextlib.contextmanager
def bytecode_cache() -> Iterator[None]:
    """Compiled bytecode for every Python process of the run, in a temporary folder.

    With ``PYTHONDONTWRITEBYTECODE`` set (this machine's image and CI's set it), no
    process keeps what it compiled, and every launch compiles mpidl's modules (and the
    tests') from source again: importing what ``mpidl train`` needs took 0.37-0.42 s a
    process against 0.17-0.18 s with compiled files (2026-12-02), and the integration tier
    alone starts over a thousand processes. Here the run's processes write and read their
    bytecode in a folder of their own (``PYTHONPYCACHEPREFIX``), removed at the end, so
    that nothing is written beside the sources and the environment is as it was. A
    prefix the caller set is kept, and without ``PYTHONDONTWRITEBYTECODE`` Python caches
    as usual: nothing to do.
    """
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        yield
        return
    saved = os.environ.pop("PYTHONDONTWRITEBYTECODE")
    try:
        with tempfile.TemporaryDirectory(prefix="mpidl-tests-bytecode-") as folder:
            os.environ["PYTHONPYCACHEPREFIX"] = folder
            try:
                yield
            finally:
                del os.environ["PYTHONPYCACHEPREFIX"]
    finally:
        os.environ["PYTHONDONTWRITEBYTECODE"] = saved


def _counts(xml_path: str) -> dict[str, int]:
    """passed/failed/skipped from a pytest JUnit XML report (all zero if it is missing)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if not os.path.exists(xml_path):
        return counts
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    for s in suites:
        tests, skipped = int(s.get("tests", 0)), int(s.get("skipped", 0))
        failed = int(s.get("failures", 0)) + int(s.get("errors", 0))
        counts["failed"] += failed
        counts["skipped"] += skipped
        counts["passed"] += tests - failed - skipped
    return counts


def installation_problems(python: str = sys.executable) -> list[str]:
    """What fails of mpidl's installation in ``python``'s environment ([] if nothing).

    Checked from outside the source tree and without ``PYTHONPATH``, so that the
    checkout's ``mpidl/`` does not stand in for an installed copy: ``import mpidl`` and
    its distribution's metadata, and ``mpidl --help`` through the console script next
    to ``python`` (where pip puts it in a virtual environment).
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = os.path.join(os.path.dirname(python), "mpidl")
    checks = [
        (f"`import mpidl` in {python}",
         [python, "-c", "import importlib.metadata, mpidl; importlib.metadata.version('mpidl')"]),
        (f"the console script {script}", [script, "--help"]),
    ]
    problems = []
    with tempfile.TemporaryDirectory(prefix="mpidl-install-check-") as away:
        for what, cmd in checks:
            try:
                proc = subprocess.run(cmd, cwd=away, env=env, capture_output=True, text=True,
                                      timeout=120)
                error = proc.stderr.strip().splitlines()[-1:] if proc.returncode else None
            except OSError as e:
                error = [str(e)]
            if error is not None:
                problems.append(f"{what} fails: {' '.join(error) or 'no message'}")
    return problems


def worker(report_dir: str, pytest_args: list[str]) -> int:
    """One rank of an MPI test run (started by mpiexec)."""
    from hpc.env import detect

    rank = detect().rank
    if rank != 0:
        log = open(os.path.join(report_dir, f"rank-{rank}.log"), "w")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    import pytest

    xml = os.path.join(report_dir, f"rank-{rank}.xml")
    return int(pytest.main(["--with-mpi", f"--junitxml={xml}", *pytest_args]))


def workers(name: str) -> list[str]:
    """pytest-xdist's arguments for a tier that runs its tests in parallel ([] where it
    does not, or where pytest-xdist is not installed, or on one core)."""
    cores = os.cpu_count() or 1
    if name not in PARALLEL or cores < 2 or importlib.util.find_spec("xdist") is None:
        return []
    n = min(cores, 4) if PARALLEL[name] == "load" else min(cores + 1, 5)
    return ["-n", str(n), "--dist", PARALLEL[name]]


def _marked_serial(paths: list[str]) -> bool:
    """Whether a test file under ``paths`` marks a test ``serial`` (read, not imported)."""
    for path in paths:
        for folder, _, files in os.walk(os.path.join(ROOT, path)):
            for name in files:
                if name.startswith("test_") and name.endswith(".py"):
                    with open(os.path.join(folder, name)) as f:
                        if "mark.serial" in f.read():
                            return True
    return False


def _pytest(name: str, cmd: list[str], timeout: float) -> int:
    print(f"\n=== single-process tests, {name}: {' '.join(cmd[3:])}", flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"!!! single-process tests, {name}, did not finish in {timeout:.0f} s", flush=True)
        return 1


def run_single(name: str, paths: list[str], pytest_args: list[str], report_dir: str,
               timeout: float, select: str | None = None) -> tuple[int, dict]:
    """One single-process tier; ``select``, a marker expression, keeps only its tests."""
    xml = os.path.join(report_dir, f"single-{name.replace(' ', '-')}.xml")
    parallel = workers(name)

    def only(marks: str | None) -> list[str]:
        both = " and ".join(f"({m})" for m in (select, marks) if m)
        return ["-m", both] if both else []

    if not parallel or not _marked_serial(paths):
        code = _pytest(name, [sys.executable, "-m", "pytest", *paths, *parallel, *only(None),
                              f"--junitxml={xml}", *pytest_args], timeout)
        # pytest exits 5 when nothing was collected: not a failure for a partial checkout.
        return (0 if code == 5 else code), _counts(xml)
    # The tests marked `serial` want the machine to themselves: after the others, alone.
    total, worst = {"passed": 0, "failed": 0, "skipped": 0}, 0
    for part, marks, extra in (("", "not serial", parallel), (", serial", "serial", [])):
        part_xml = xml.replace(".xml", f"{part.replace(', ', '-')}.xml")
        code = _pytest(name + part, [sys.executable, "-m", "pytest", *paths, *extra,
                                     *only(marks), f"--junitxml={part_xml}", *pytest_args],
                       timeout)
        worst = worst or (0 if code == 5 else code)
        for k, v in _counts(part_xml).items():
            total[k] += v
    return worst, total


def run_mpi(size: int, pytest_args: list[str], report_dir: str, timeout: float,
            paths: list[str] = MPI, name: str = "mpi") -> tuple[int, dict]:
    from mpidl.testing.launch import LaunchTimeout, mpiexec

    sub = os.path.join(report_dir, f"{name}-{size}")
    os.makedirs(sub, exist_ok=True)
    args = [sys.executable, os.path.join(HERE, "run.py"), "--worker", sub, "--", *paths, *pytest_args]
    print(f"\n=== {' '.join(paths)} on {size} rank{'s' if size > 1 else ''}", flush=True)
    try:
        result = mpiexec(size, args, timeout=timeout, cwd=ROOT)
    except LaunchTimeout as e:
        print(f"!!! {e}", flush=True)
        return 1, _counts(os.path.join(sub, "rank-0.xml"))
    sys.stdout.write(result.stdout)
    sys.stdout.write(result.stderr)
    code = result.returncode
    for rank in range(1, size):
        if _counts(os.path.join(sub, f"rank-{rank}.xml"))["failed"] or code not in (0, 5):
            log = os.path.join(sub, f"rank-{rank}.log")
            if os.path.exists(log):
                print(f"--- output of rank {rank} ---\n{open(log).read()[-20000:]}", flush=True)
    missing = [r for r in range(size) if not os.path.exists(os.path.join(sub, f"rank-{r}.xml"))]
    if missing:
        print(f"!!! ranks {missing} wrote no report", flush=True)
        code = code or 1
    return (0 if code == 5 else code), _counts(os.path.join(sub, "rank-0.xml"))


# The main job's bar, as tests/integration/test_train.py's test_default_job_reaches_its_accuracy.
MAIN_JOB_ACCURACY = 0.9


def run_main_job(report_dir: str, timeout: float) -> tuple[int, dict]:
    """README's main job, ``mpiexec -n 2 mpidl train``, in a folder of its own (its run
    directory and corpus cache there); one test: passed when it exits 0 and its last
    evaluation (metrics.jsonl) reaches :data:`MAIN_JOB_ACCURACY`."""
    import json

    from mpidl.testing.launch import LaunchTimeout, mpiexec

    work = os.path.join(report_dir, "main-job")
    os.makedirs(work)
    cmd = [sys.executable, "-m", "mpidl", "train", f"--run-dir={work}/run",
           f"--data.cache-dir={work}/cache"]
    print(f"\n=== the main job: mpiexec -n 2 {' '.join(cmd)}", flush=True)
    try:
        result = mpiexec(2, cmd, timeout=timeout, cwd=work)
    except LaunchTimeout as e:
        print(f"!!! {e}", flush=True)
        return 1, {"passed": 0, "failed": 1, "skipped": 0}
    print(result.stdout[-3000:] + result.stderr[-3000:], flush=True)
    accuracy = None
    if os.path.exists(f"{work}/run/metrics.jsonl"):
        with open(f"{work}/run/metrics.jsonl") as f:
            evals = [r for r in map(json.loads, f) if "test_accuracy" in r]
        accuracy = evals[-1]["test_accuracy"] if evals else None
    ok = result.returncode == 0 and accuracy is not None and accuracy >= MAIN_JOB_ACCURACY
    if result.returncode == 0 and not ok:
        print(f"!!! the main job's last test accuracy is {accuracy}, under its bar of "
              f"{MAIN_JOB_ACCURACY}", flush=True)
    return (result.returncode or int(not ok)), {"passed": int(ok), "failed": int(not ok),
                                                "skipped": 0}


def other_mpi(argv: list[str], mpi: str) -> int | None:
    """For ``--mpi MPI``: run this command again in that MPI's environment (made or reused
    first, its time reported) and return its status; None when this is that environment."""
    from mpienv import ensure_venv, venv_dir

    if os.path.realpath(sys.prefix) == os.path.realpath(venv_dir(ROOT, mpi)):
        return None
    start = time.monotonic()
    try:
        python = ensure_venv(ROOT, mpi)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"!!! the {mpi} environment could not be made: {e}", flush=True)
        print("suite: 0 passed, 1 failed, 0 skipped")
        return 1
    env = dict(os.environ, MPIDL_MPIENV_SECONDS=f"{time.monotonic() - start:.0f}")
    return subprocess.run([str(python), os.path.join(HERE, "run.py"), *argv], env=env).returncode


def tiers(args: argparse.Namespace) -> tuple[dict[str, list[str]], list[int], list[int]]:
    """What a command line asks for: the single-process launches (name: paths), the MPI
    sizes of tests/mpi and those of tests/many."""
    def parse(text: str | None, default: str) -> list[int]:
        return [int(s) for s in (text or default).split(",") if s]

    if args.mpi:
        return dict(OTHER_MPI), parse(args.sizes, ",".join(map(str, OTHER_MPI_SIZES))), []
    if args.quick:
        return {"unit": CORE["unit"]}, parse(args.sizes, "2"), []
    if args.extras:  # README's install skips these; CI runs them once the extras are in
        return dict(CORE), [], []
    named = args.all or args.slurm or args.cluster or args.many
    if not named and (args.sizes is not None or args.many_sizes is not None):
        # `--sizes 2` asks for the MPI tests at 2 ranks, not for the whole suite too.
        return ({}, parse(args.sizes, "") if args.sizes is not None else [],
                parse(args.many_sizes, "") if args.many_sizes is not None else [])
    single, sizes, many_sizes = {}, [], []
    if args.all or not named:
        single.update(CORE)
        sizes = parse(args.sizes, "1,2,3")
    if args.all or args.slurm:
        single.update(SLURM)
    if args.all or args.cluster:
        single.update(CLUSTER)
    if args.all or args.many:
        single.update(MANY_SINGLE)
        many_sizes = parse(args.many_sizes, "8,16")
    return single, sizes, many_sizes


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        rest = argv[2:]
        return worker(argv[1], rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a developer's check: tests/unit and the MPI tests at 2 ranks")
    parser.add_argument("--slurm", action="store_true",
                        help="the Slurm tier (tests/slurm): a local Slurm")
    parser.add_argument("--cluster", action="store_true",
                        help="the virtual cluster tier (tests/cluster)")
    parser.add_argument("--many", action="store_true",
                        help="the many-rank tier (tests/many): its single-process test and "
                             "8 and 16 ranks (or --many-sizes)")
    parser.add_argument("--extras", action="store_true",
                        help="only the single-process tests marked `extra`: those that need "
                             "an extra beyond [mpi,test] (torch, matplotlib) and skip without it")
    parser.add_argument("--all", action="store_true",
                        help="the core tiers, Slurm, the virtual cluster and the many-rank "
                             "tier (what CI runs)")
    parser.add_argument("--sizes", default=None,
                        help="MPI sizes to run tests/mpi at (default 1,2,3); given alone, "
                             "only the MPI tests run")
    parser.add_argument("--many-sizes", default=None,
                        help="sizes to run the many-rank tier (tests/many) at (default 8,16); "
                             "given alone, only that tier's MPI runs")
    parser.add_argument("--mpi", choices=("mpich", "impi"), default=None,
                        help="the tier of another MPI, in a second environment with its "
                             "wheel (.venv-mpich, .venv-impi; made or reused): MPI tests at "
                             "2 and 3 ranks, signals, watchdog, the main job")
    parser.add_argument("--no-mpi", action="store_true", help="skip the MPI tests")
    parser.add_argument("--no-single", action="store_true", help="skip the single-process tests")
    # Per launch: the integration tier took ~900 s one test at a time on CI's 2-core
    # machine (2026-12-02); every test has its own pytest-timeout, this catches the rest.
    parser.add_argument("--timeout", type=float, default=1800,
                        help="limit per launch, seconds")
    parser.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments")
    args = parser.parse_args(argv)
    if args.mpi:
        code = other_mpi(argv, args.mpi)
        if code is not None:
            return code

    single, sizes, many_sizes = tiers(args)
    if args.no_single:
        single = {}
    if args.no_mpi:
        sizes, many_sizes = [], []
    for key, value in LAUNCH_ENV.items():
        os.environ.setdefault(key, value)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    failures, times = [], []
    installed_before = not installation_problems()
    with bytecode_cache(), tempfile.TemporaryDirectory(prefix="mpidl-tests-") as report_dir:
        runs = [(f"single-process, {name}", lambda name=name, paths=paths: run_single(
                    name, paths, args.pytest_args, report_dir, args.timeout,
                    "extra" if args.extras else None))
                for name, paths in single.items()]
        runs += [(f"MPI at {n} ranks", lambda n=n: run_mpi(
                    n, args.pytest_args, report_dir, args.timeout)) for n in sizes]
        # The many-rank tier, 2 cores (2026-12-02): 8 and 16 ranks 52 s (pytest 13 + 22 s),
        # its watchdog test in the single-process launch 17 s, at a load of ~2-9; 121 s
        # and 21 s with other jobs loading the machine to ~24. 32 ranks took 114 s.
        runs += [(f"many ranks: {n}", lambda n=n: run_mpi(
                    n, args.pytest_args, report_dir, args.timeout, MANY, "many"))
                 for n in many_sizes]
        if args.mpi and not args.no_mpi:
            runs.append(("the main job", lambda: run_main_job(report_dir, MAIN_JOB_TIMEOUT_S)))
        if os.environ.get("MPIDL_MPIENV_SECONDS"):
            times.append(f"{args.mpi} environment {os.environ['MPIDL_MPIENV_SECONDS']} s")
        for name, run in runs:
            start = time.monotonic()
            code, counts = run()
            times.append(f"{name} {time.monotonic() - start:.0f} s")
            if code != 0 and not counts["failed"]:
                # Killed (a timeout) or crashed before its report said what failed: the
                # run still counts as a failure in the summary, not as 0 failed.
                counts = dict(counts, failed=1)
            for k in total:
                total[k] += counts[k]
            if code != 0:
                failures.append(f"{name} (exit {code})")
    problems = installation_problems()
    if problems:
        # A test that installs or uninstalls packages in this environment (pip install
        # --prefix removed the installed mpidl, issue #13) breaks the next run and the user.
        cause = ("the test run removed it: some test changed this environment's packages"
                 if installed_before else
                 f"it was not installed: `{sys.executable} -m pip install -e '.[mpi,test]'`")
        print("\n!!! mpidl is not usable in this environment after the tests; " + cause)
        for p in problems:
            print(f"!!!   {p}")
        failures.append("installation check")
        total["failed"] += 1
    print()
    if times:
        print("times: " + "; ".join(times))
    if failures:
        print("FAILED: " + "; ".join(failures))
    print(f"suite: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
