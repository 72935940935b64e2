"""Every test that needs an extra beyond README's install is marked `extra`.

README's test command runs in README's install ([mpi,test]), where such a test skips; CI
then adds the extras and runs `tests/run.py --extras`, which selects the tests marked
`extra`. An unmarked test that imports torch or matplotlib would skip in the first run and
never be selected in the second: it would run nowhere.
"""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
EXTRAS = {"torch", "matplotlib", "transformers", "safetensors"}  # [oracle] [plot] [interop]


def _needs(node: ast.AST) -> set[str]:
    """The extras that ``node`` asks for with ``pytest.importorskip("...")``."""
    return {c.args[0].value for c in ast.walk(node)
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == "importorskip" and c.args
            and isinstance(c.args[0], ast.Constant)
            and c.args[0].value.split(".")[0] in EXTRAS}


def _marks_extra(decorators_or_value: list[ast.expr] | ast.expr | None) -> bool:
    text = "" if decorators_or_value is None else (
        " ".join(ast.unparse(d) for d in decorators_or_value)
        if isinstance(decorators_or_value, list) else ast.unparse(decorators_or_value))
    return "mark.extra(" in text


def unmarked(source: str) -> list[str]:
    """Names of the tests in ``source`` that import an extra without the `extra` mark."""
    tree = ast.parse(source)
    module_mark = next((n.value for n in tree.body if isinstance(n, ast.Assign)
                        and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)), None)
    if _marks_extra(module_mark):
        return []
    bad = ["<module>"] if any(_needs(n) for n in tree.body if isinstance(n, ast.Expr)) else []
    for node in ast.walk(tree):
        if (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
                and _needs(node) and not _marks_extra(node.decorator_list)):
            bad.append(node.name)
    return bad


def test_every_test_that_imports_an_extra_is_marked_extra():
    found = {str(p.relative_to(TESTS)): unmarked(p.read_text())
             for p in sorted(TESTS.rglob("test_*.py"))}
    bad = {path: names for path, names in found.items() if names}
    assert not bad, ("tests that import torch or matplotlib without @pytest.mark.extra(...): "
                     f"{bad}; README's install skips them and `tests/run.py --extras` would "
                     "not select them")


def test_the_check_finds_an_unmarked_test_and_accepts_a_marked_one():
    unmarked_test = 'import pytest\ndef test_a():\n    torch = pytest.importorskip("torch")\n'
    assert unmarked(unmarked_test) == ["test_a"]
    marked = ('import pytest\n@pytest.mark.extra("torch")\ndef test_a():\n'
              '    torch = pytest.importorskip("torch")\n')
    assert unmarked(marked) == []
    module = 'import pytest\npytest.importorskip("matplotlib")\ndef test_b():\n    pass\n'
    assert unmarked(module) == ["<module>"]
    assert unmarked('import pytest\npytestmark = pytest.mark.extra("matplotlib")\n' + module) == []
