"""Mutation check: plant a plausible mistake in the library, see that a fast test fails.

Each mutation of :data:`mutation_list.MUTATIONS` replaces one exact piece of text of a
library file (``mpidl/`` or ``hpc/``) by a wrong version of it, and names the tests
of the fast tiers that must catch it: ``tests/unit`` (run in one process) and
``tests/mpi`` (run under ``mpiexec`` at 2 and 3 ranks, or at the sizes the mutation
names). A mutation is *caught* when one of its tests fails (or its launch times out or
crashes: the report says which), and *survives* when they all pass. Not part of CI; the
last result goes into the docs with its date. Run from the repository root::

    .venv/bin/python benchmarks/mutations.py                      # every mutation
    .venv/bin/python benchmarks/mutations.py --list               # what is in the list
    .venv/bin/python benchmarks/mutations.py --only adam-bias-correction sampler-epoch-ignored
    .venv/bin/python benchmarks/mutations.py --sizes 3 --json mutations.json --timeout 120

How it works. The checkout's files (``git ls-files --cached --others
--exclude-standard``: tracked, and untracked but not ignored) are copied once into a
temporary directory, and every test runs there, with ``PYTHONPATH`` set to it, so each
process, every MPI rank included, imports the scratch ``mpidl`` and ``hpc``, not the
installed (editable) ones; a self-check proves this at the start, by a planted constant
that a test must see in one process and on every rank. Then a baseline: every listed
test must pass on the unmutated copy (else "caught" would mean nothing, and the run
stops naming the failures). Each mutation is written into the scratch copy, its tests
run (the unit tests first, then each MPI size, stopping at the first failure), and the
file is restored. The checkout is never written: its ``git status`` and the contents
of the files the mutations touch are compared before and after, and a checkout file that
ends up holding a mutation fails the run loudly. The scratch directory is removed at
the end, also on Ctrl-C.

Output: one line per mutation (caught or survived, by which test, seconds), then
``stale: K`` (mutations whose original text no longer occurs exactly once: the library
moved on, the mutation needs updating), and the last line ``mutations: N caught, M
survived``. The exit status is 0 when every mutation was caught, 1 when one survived or
is stale, 2 when the self-check or the baseline failed, 3 when a checkout file holds a
mutation (other changes to the checkout during the run, someone else's edits, are
listed but do not fail it).

Adding a mutation: append a :class:`mutation_list.Mutation` to ``MUTATIONS`` in
``benchmarks/mutation_list.py``, with a short unique ``name``, the ``file``, the exact
``original`` text (it must occur once in the file: take enough context), the
``mutated`` text, ``why`` (the mistake it stands for, one line) and the narrowest
``tests`` that catch it (pytest node ids or files under ``tests/unit`` or
``tests/mpi``). Then ``--only NAME`` must report it caught. A mutation that survives
every existing test is a finding: write the test that catches it first.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Callable  # noqa: E402

from mutation_list import MUTATIONS, Mutation  # noqa: E402

from mpidl.testing.launch import (Launched, LaunchTimeout, _stop_group,  # noqa: E402
                                  launch_env, mpiexec_command, retry_startup)

UNIT, MPI = "tests/unit", "tests/mpi"
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "--color=no", "-q", "-rfE"]
# A failed test's line in pytest's short summary (-rfE): "FAILED tests/...::name - why".
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
# A test function in the stacks pytest-timeout prints before it ends a stuck process.
_STUCK = re.compile(r'File "[^"]*/(tests/[^"]+\.py)", line \d+, in (test_\w+)')


@dataclass
class Outcome:
    """What one group of tests did: passed, or why not (``how``) and which tests failed."""

    passed: bool
    how: str = ""  # "failed", "timed out after N s", "test timed out", "crashed (exit N)"
    failed: list[str] = field(default_factory=list)
    where: str = ""  # "unit", "2 ranks", ...
    output: str = ""

    def describe(self) -> str:
        tests = ", ".join(self.failed[:3]) + (" ..." if len(self.failed) > 3 else "")
        return f"{self.how} at {self.where}" + (f": {tests}" if tests else "")


@dataclass
class Result:
    """One mutation's verdict: ``caught``, ``survived`` or ``stale``, and by what."""

    name: str
    file: str
    result: str
    by: str
    seconds: float


# -- the checkout and its scratch copy ---------------------------------------------------
def checkout_files(root: str) -> list[str]:
    """The files a scratch copy holds: tracked ones, and untracked ones not ignored."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    return sorted({p for p in out.split("\0") if p})


def checkout_state(root: str, files: list[str]) -> tuple[str, dict[str, str]]:
    """``git status --porcelain`` and the text of each of ``files`` ("" if absent)."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                            cwd=root, capture_output=True, text=True, check=True).stdout
    return status, {f: _read(os.path.join(root, f)) for f in files}


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def make_scratch(root: str) -> str:
    """A temporary copy of the checkout's files (see :func:`checkout_files`)."""
    scratch = tempfile.mkdtemp(prefix="mpidl-mutations-")
    try:
        for rel in checkout_files(root):
            dst = os.path.join(scratch, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            try:
                shutil.copy2(os.path.join(root, rel), dst, follow_symlinks=False)
            except FileNotFoundError:  # tracked but deleted in the working tree
                pass
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return scratch


def write_source(path: str, text: str) -> None:
    """Write a module's text and drop its cached bytecode.

    A mutation often keeps the file's size, and its write and the restore can fall in
    the same second: bytecode validated by (mtime, size) would then be the other
    version's. Removing it makes the next import compile what is there.
    """
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    if path.endswith(".py"):
        try:
            os.remove(importlib.util.cache_from_source(path))
        except FileNotFoundError:
            pass


# -- running tests in the scratch copy ---------------------------------------------------
def _run(cmd: list[str], timeout: float, env: dict[str, str], cwd: str) -> Launched:
    """:func:`mpidl.testing.launch.run`, which also stops the launched process group when
    this process is interrupted: the group is a session of its own, which a Ctrl-C at
    the terminal does not reach, so without this a test job would outlive the tool."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _stop_group(proc)
        raise LaunchTimeout(f"{' '.join(cmd)} did not finish in {timeout:.0f} s (killed).\n"
                            f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}"
                            ) from None
    except BaseException:
        _stop_group(proc)
        raise
    return Launched(proc.returncode, out, err, time.monotonic() - t0)


class Runner:
    """Runs pytest in ``scratch`` with the scratch packages first on every process's path."""

    def __init__(self, scratch: str, timeout: float) -> None:
        self.scratch, self.timeout = scratch, timeout
        # PYTHONPATH alone, not the caller's: the checkout must not stand in for the copy.
        self.env = launch_env({"PYTHONPATH": scratch})

    def run(self, where: str, tests: list[str], every_failure: bool = False) -> Outcome:
        """``tests`` in one process (``where == "unit"``) or on ``int(where)`` ranks.
        Stops at the first failure (all a mutation needs) unless ``every_failure``."""
        cmd = [sys.executable, *PYTEST, *([] if every_failure else ["-x"])]
        if where == "unit":
            return self._outcome(
                lambda: _run([*cmd, *tests], self.timeout, self.env, self.scratch), "unit")
        cmd = mpiexec_command(int(where), [*cmd, "--with-mpi", *tests])
        return self._outcome(
            lambda: retry_startup(lambda: _run(cmd, self.timeout, self.env, self.scratch)),
            f"{where} ranks")

    def _outcome(self, launch: Callable[[], Launched], where: str) -> Outcome:
        try:
            done = launch()
        except LaunchTimeout as e:
            return Outcome(False, f"timed out after {self.timeout:.0f} s", where=where,
                           output=str(e))
        output = done.stdout + done.stderr
        failed = list(dict.fromkeys(_FAILED.findall(output)))  # every rank prints them
        if done.returncode == 0:
            return Outcome(True, where=where, output=output)
        if failed:
            how = "failed"
        elif "+++ Timeout +++" in output:  # pytest-timeout ended the process
            how = "test timed out"
            failed = list(dict.fromkeys(f"{path}::{name}" for path, name in _STUCK.findall(output)))
        else:
            how = f"crashed (exit {done.returncode})"
        return Outcome(False, how, failed, where, output)


def tier(test: str) -> str | None:
    """:data:`UNIT` or :data:`MPI`: the directory ``test`` (a node id, file or folder) is
    in; None for any other."""
    for directory in (UNIT, MPI):
        if test == directory or test.startswith(directory + "/"):
            return directory
    return None


def plan(m: Mutation, sizes: list[int]) -> list[tuple[str, list[str]]]:
    """``[(where, tests)]`` of a mutation: its unit tests, then its MPI tests per size."""
    unit = [t for t in m.tests if tier(t) == UNIT]
    mpi = [t for t in m.tests if tier(t) == MPI]
    steps = [("unit", unit)] if unit else []
    if mpi:
        steps += [(str(n), mpi) for n in (m.sizes or sizes)]
    return steps


# -- the checks ------------------------------------------------------------------------
SELF_CHECK_TEST = "tests/unit/test_zz_mutation_self_check.py"
SELF_CHECK_BODY = '''\
import os

import hpc
import mpidl

SCRATCH = {scratch!r}


def test_the_scratch_packages_are_imported():
    for module in (mpidl, hpc):
        assert os.path.realpath(module.__file__).startswith(os.path.realpath(SCRATCH)), (
            module.__file__)
    assert getattr(mpidl, "MUTATION_SELF_CHECK", None) == {token!r}
'''


def self_check(runner: Runner, size: int) -> str | None:
    """None if a planted constant in the scratch ``mpidl`` is seen by a test in one
    process and on ``size`` ranks; else what went wrong."""
    init = os.path.join(runner.scratch, "mpidl", "__init__.py")
    test = os.path.join(runner.scratch, SELF_CHECK_TEST)
    with open(init, encoding="utf-8") as f:
        original = f.read()
    token = f"planted-{os.getpid()}-{time.time()}"
    try:
        write_source(init, original + f"\nMUTATION_SELF_CHECK = {token!r}\n")
        write_source(test, SELF_CHECK_BODY.format(scratch=runner.scratch, token=token))
        for where in ("unit", str(size)):
            out = runner.run(where, [SELF_CHECK_TEST])
            if not out.passed or "1 passed" not in out.output:
                return f"{out.how or 'not run'} at {out.where}:\n{out.output[-3000:]}"
    finally:
        write_source(init, original)
        if os.path.exists(test):
            os.remove(test)
    return None


def baseline(runner: Runner, chosen: list[Mutation], sizes: list[int]) -> list[Outcome]:
    """Every listed test on the unmutated copy, grouped per launch; the failed groups."""
    groups: dict[str, list[str]] = {}
    for m in chosen:
        for where, tests in plan(m, sizes):
            groups.setdefault(where, [])
            groups[where] += [t for t in tests if t not in groups[where]]
    order = sorted(groups, key=lambda w: -1 if w == "unit" else int(w))
    bad = []
    for where in order:
        t0 = time.monotonic()
        out = runner.run(where, groups[where], every_failure=True)
        label = "unit" if where == "unit" else f"{where} ranks"
        print(f"baseline {label:<8} {len(groups[where]):3d} test ids  "
              f"{'passed' if out.passed else out.describe()}  {time.monotonic() - t0:.0f} s",
              flush=True)
        if not out.passed:
            bad.append(out)
    return bad


def staleness(m: Mutation, text: str) -> str:
    """Why ``m`` no longer fits ``text``, its file's contents ("" when it does)."""
    count = text.count(m.original)
    if count == 1:
        return ""
    return (f"the original text occurs {count} times in {m.file}, not once" if text
            else f"{m.file} is missing or empty")


def try_mutation(runner: Runner, m: Mutation, sizes: list[int]) -> Result:
    t0 = time.monotonic()
    path = os.path.join(runner.scratch, m.file)
    original = _read(path)
    stale = staleness(m, original)
    if stale:
        return Result(m.name, m.file, "stale", stale, time.monotonic() - t0)
    try:
        write_source(path, original.replace(m.original, m.mutated))
        passed = []
        for where, tests in plan(m, sizes):
            out = runner.run(where, tests)
            if not out.passed:
                return Result(m.name, m.file, "caught", out.describe(),
                              time.monotonic() - t0)
            passed.append(out.where)
        return Result(m.name, m.file, "survived",
                      f"every listed test passed at {', '.join(passed)}", time.monotonic() - t0)
    finally:
        write_source(path, original)


def checkout_changes(root: str, before: tuple[str, dict[str, str]],
                     chosen: list[Mutation]) -> tuple[list[str], list[str]]:
    """``(ours, others)``: checkout files now holding one of ``chosen``'s mutations, and
    other differences from ``before`` (someone else editing the checkout meanwhile)."""
    status, texts = checkout_state(root, list(before[1]))
    ours, others = [], []
    for rel, old in before[1].items():
        now = texts[rel]
        if now == old:
            continue
        planted = [m.name for m in chosen
                   if m.file == rel and now == old.replace(m.original, m.mutated, 1)]
        (ours if planted else others).append(
            f"{rel} ({'holds ' + ', '.join(planted) if planted else 'edited'})")
    if status != before[0]:
        was, now = set(before[0].splitlines()), set(status.splitlines())
        others.append("git status changed:\n" + "".join(
            [f"    before: {line}\n" for line in sorted(was - now)]
            + [f"    after:  {line}\n" for line in sorted(now - was)]))
    return ours, others


# -- command line ----------------------------------------------------------------------
def _interrupted(signum: int, frame: object) -> None:
    """SIGTERM (a job's time limit) ends the run as Ctrl-C does, through the cleanup."""
    raise KeyboardInterrupt


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    p.add_argument("--list", action="store_true", help="print the mutations and exit")
    p.add_argument("--sizes", default="2,3",
                   help="MPI sizes for the tests/mpi tests (default 2,3; a mutation may "
                        "name its own)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--timeout", type=float, default=300,
                   help="wall-clock limit of each test launch, seconds (default 300)")
    args = p.parse_args(argv)
    try:
        args.sizes = sorted({int(s) for s in args.sizes.split(",") if s})
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: write MPI sizes separated by commas, e.g. 2,3")
    if not args.sizes or min(args.sizes) < 1:
        p.error(f"--sizes {args.sizes}: need at least one size >= 1")
    return args


def check_list(mutations: list[Mutation]) -> list[str]:
    """What is wrong with the list itself: duplicate names, tests outside the fast tiers."""
    problems, seen = [], set()
    for m in mutations:
        if m.name in seen:
            problems.append(f"{m.name}: the name is used twice")
        seen.add(m.name)
        if not m.tests:
            problems.append(f"{m.name}: names no test")
        for t in m.tests:
            if tier(t) is None:
                problems.append(f"{m.name}: test {t} is in neither {UNIT} nor {MPI}")
        if m.original == m.mutated:
            problems.append(f"{m.name}: the mutated text is the original")
    return problems


def run_checks(runner: Runner, chosen: list[Mutation], args: argparse.Namespace,
               results: list[Result]) -> int:
    """The self-check, the baseline and the mutations, in the scratch copy; appends to
    ``results``; 0, or 2 when the self-check or the baseline failed."""
    print(f"scratch copy {runner.scratch}; {len(chosen)} mutations; MPI sizes "
          f"{','.join(map(str, args.sizes))}; limit {args.timeout:.0f} s a launch", flush=True)
    wrong = self_check(runner, min(args.sizes))
    if wrong:
        print(f"self-check FAILED: the tests do not import the scratch copy's mpidl ({wrong})")
        return 2
    print("self-check: one process and every rank import the scratch mpidl and hpc", flush=True)
    bad = baseline(runner, chosen, args.sizes)
    if bad:
        print("baseline FAILED: these tests fail without any mutation, so a failure could "
              "not tell a caught mutation; fix them or list other tests:")
        for out in bad:
            print(f"--- {out.describe()}\n{out.output[-4000:]}")
        return 2
    width = max(len(m.name) for m in chosen)
    for m in chosen:
        r = try_mutation(runner, m, args.sizes)
        results.append(r)
        print(f"{r.name:<{width}}  {r.result:<8}  {r.seconds:6.1f} s  {r.by}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    problems = check_list(MUTATIONS)
    if problems:
        print("the mutation list is inconsistent:\n  " + "\n  ".join(problems))
        return 2
    chosen = MUTATIONS
    if args.only:
        known = {m.name for m in MUTATIONS}
        unknown = [n for n in args.only if n not in known]
        if unknown:
            print(f"unknown mutation(s) {', '.join(unknown)}; --list shows the names")
            return 2
        chosen = [m for m in MUTATIONS if m.name in args.only]
    if args.list:
        stale = 0
        for m in chosen:
            sizes = ",".join(map(str, m.sizes)) if m.sizes else "default"
            why_stale = staleness(m, _read(os.path.join(ROOT, m.file)))
            stale += bool(why_stale)
            print(f"{m.name}  {m.file}  (MPI sizes {sizes})"
                  + (f"  STALE: {why_stale}" if why_stale else "")
                  + f"\n    {m.why}\n    " + "\n    ".join(m.tests))
        print(f"{len(chosen)} mutations, {stale} stale in the checkout")
        return 0

    signal.signal(signal.SIGTERM, _interrupted)
    started = time.monotonic()
    before = checkout_state(ROOT, sorted({m.file for m in chosen}))
    scratch = make_scratch(ROOT)
    results: list[Result] = []
    try:
        code = run_checks(Runner(scratch, args.timeout), chosen, args, results)
    except KeyboardInterrupt:
        print("\ninterrupted: removing the scratch copy", file=sys.stderr)
        code = 130
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        ours, others = checkout_changes(ROOT, before, chosen)
        if ours:
            print("!!! THE CHECKOUT WAS CHANGED BY THIS RUN: " + "; ".join(ours)
                  + "\n!!! undo that replacement by hand (the mutation's `mutated` text "
                    "back to its `original`); the rest of the file may be others' work")
            code = 3
        elif others:
            print("note: the checkout changed during the run, not by this tool (no file "
                  "holds a mutation): " + "; ".join(others))
    if code:
        return code

    caught = sum(r.result == "caught" for r in results)
    survived = [r.name for r in results if r.result == "survived"]
    stale = [r.name for r in results if r.result == "stale"]
    total_s = time.monotonic() - started
    if args.json:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        record = {"date": now, "sizes": args.sizes, "seconds": round(total_s, 1),
                  "results": [dict(r.__dict__, seconds=round(r.seconds, 1)) for r in results]}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    print(f"total {total_s:.0f} s")
    print(f"stale: {len(stale)}" + (f" ({', '.join(stale)})" if stale else ""))
    print(f"mutations: {caught} caught, {len(survived)} survived")
    return 1 if survived or stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
