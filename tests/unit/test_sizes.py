"""No module over 600 lines, and no function or method over 60, docstring included.

Code is read far more often than it is written: a function that fits on a screen is read whole, and a
module of a few hundred lines is one subject. Small units also keep the place of the next feature
obvious; it goes into the step it belongs to, not into the middle of a long function. A function is
counted from its ``def`` to its last line; nested functions count on their own and in the function
around them. Argument parsers (functions named ``add_arguments``) are exempt: a list of flags is read
one line at a time, and splitting it would only scatter it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "vllm_disagg"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
EXEMPT = frozenset({"add_arguments"})
MODULES = sorted(ROOT.rglob("*.py"))
Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, Function]]:
    """Every function and method under ``node`` with its qualified name (``Class.method.inner``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, Function):
            yield prefix + child.name, child
        inner = f"{prefix}{child.name}." if isinstance(child, Function | ast.ClassDef) else prefix
        yield from _functions(child, inner)


def _id(path: Path) -> str:
    """A module's path from the checkout's root, as the test's id and in its message."""
    return str(path.relative_to(ROOT.parent))


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_module_is_at_most_600_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_id(path)} has {lines} lines"


@pytest.mark.parametrize("path", MODULES, ids=_id)
def test_every_function_is_at_most_60_lines(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    long = {
        name: length
        for name, fn in _functions(tree)
        if fn.name not in EXEMPT
        and (length := (fn.end_lineno or fn.lineno) - fn.lineno + 1) > MAX_FUNCTION_LINES
    }
    assert not long, f"{_id(path)}: functions over {MAX_FUNCTION_LINES} lines: {long}"
