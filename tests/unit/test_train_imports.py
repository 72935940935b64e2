"""The modules of ``mpidl.train`` import each other one way only: no cycle, not even
through an import inside a function (which hides a cycle rather than removes it)."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = ROOT / "mpidl" / "train"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def train_imports(path: pathlib.Path) -> set[str]:
    """The ``mpidl.train`` modules ``path`` imports anywhere in it (functions included;
    ``if TYPE_CHECKING:`` blocks, which never run, left out)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree)
               if isinstance(node, ast.If) and _is_type_checking(node)
               for n in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "mpidl.train":  # from mpidl.train import checkpoint
                found.update(f"{node.module}.{a.name}" for a in node.names
                             if (TRAIN / f"{a.name}.py").exists())
            elif node.module.startswith("mpidl.train."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mpidl.train."))
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state:
                found = visit(other)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_the_train_modules_import_each_other_without_a_cycle():
    graph = {f"mpidl.train.{p.stem}": train_imports(p) for p in TRAIN.glob("*.py")
             if p.stem != "__init__"}
    found = cycle(graph)
    assert found is None, " -> ".join(found)


def test_mpidl_eval_builds_its_model_without_the_trainer():
    assert "mpidl.train.trainer" not in train_imports(TRAIN / "inference.py")


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


# The trainer's pieces (#24): building, the step, checkpointing, the run directory, file
# retention and the loop; each one concept, small, its imports at the top.
TRAINER_PIECES = ("build", "step", "checkpointing", "rundir", "retention", "trainer")


def _function_imports(path: pathlib.Path) -> list[int]:
    """Lines of the imports inside functions of ``path``."""
    tree = ast.parse(path.read_text())
    return [n.lineno for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_the_trainers_pieces_import_at_the_top_and_stay_small():
    for name in TRAINER_PIECES:
        path = TRAIN / f"{name}.py"
        assert _function_imports(path) == [], f"{path.name}: imports inside a function"
        lines = len(path.read_text().splitlines())
        assert lines <= 400, f"{path.name} has {lines} lines"


def test_the_trainers_pieces_do_not_import_the_loop():
    for name in TRAINER_PIECES:
        if name != "trainer":
            assert "mpidl.train.trainer" not in train_imports(TRAIN / f"{name}.py"), name


# Every module of train/ and parallel/ (#24): an import inside a function hides what a
# module depends on, so one says why beside it (a cycle it breaks, a heavy or optional
# import it defers), as a comment on its line or on the line above it or above the
# imports directly before it ("# lazy: ... (see the module's note)").
PACKAGES = (TRAIN, ROOT / "mpidl" / "parallel")


def unexplained_function_imports(source: str) -> list[int]:
    """Lines of the imports inside functions of ``source`` with no reason beside them."""
    tree = ast.parse(source)
    lines = source.splitlines()
    imports = {n for fn in ast.walk(tree)
               if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
               for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    in_import = {i for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for i in range(n.lineno, n.end_lineno + 1)}
    bad = []
    for n in imports:
        above = n.lineno - 1
        while above in in_import:  # a group of imports shares the comment above it
            above -= 1
        own = any("#" in lines[i - 1] for i in range(n.lineno, n.end_lineno + 1))
        if not own and not (above >= 1 and lines[above - 1].strip().startswith("#")):
            bad.append(n.lineno)
    return sorted(bad)


def test_every_function_local_import_in_train_and_parallel_says_why():
    bad = [f"{path.relative_to(ROOT)}:{line}" for package in PACKAGES
           for path in sorted(package.glob("*.py"))
           for line in unexplained_function_imports(path.read_text())]
    assert not bad, ("imports inside functions without a reason beside them (move them to "
                     "the top, or say which cycle or heavy import keeps them here): "
                     + ", ".join(bad))


def test_the_reason_finder_wants_a_comment_beside_each_group():
    source = ("import os\n\n\n"
              "def f():\n    import json\n\n\n"                          # 5: no reason
              "def g():\n    # lazy: heavy\n    from x import (a,\n        b)\n"
              "    import sys\n\n\n"                                       # grouped: fine
              "def h():\n    import re  # here: optional\n    x = 1\n"
              "    import csv\n")                                          # 18: alone again
    assert unexplained_function_imports(source) == [5, 18]
