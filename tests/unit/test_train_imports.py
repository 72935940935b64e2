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
