"""The house's size rules, checked on the source: no source file over 500 lines anywhere in
gptforge, and no function over 80 lines in the decoding engine (`generate/engine/`) and the
HTTP layer (`serve/`) (issue #30)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "gptforge"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
FUNCTION_RULED = ("generate/engine", "serve")


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`name (lines)` of every function or method in `path` longer than `limit` lines (its
    decorators and docstring included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            n = node.end_lineno - first + 1
            if n > limit:
                out.append(f"{node.name} ({n} lines)")
    return out


def test_the_checker_sees_a_long_function(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def short():\n    return 1\n\n\nclass A:\n    def long(self):\n" + "        x = 1\n" * 80
                 + "        return x\n", encoding="utf-8")
    assert long_functions(f) == ["long (82 lines)"]


def test_no_source_file_over_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


@pytest.mark.parametrize("package", FUNCTION_RULED)
def test_no_function_over_80_lines_in_the_engine_and_serve(package):
    found = {str(p.relative_to(SRC)): fns for p in sorted((SRC / package).rglob("*.py"))
             if (fns := long_functions(p))}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"
