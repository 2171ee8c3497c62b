"""The package's shape (docs/architecture.md): imports go downward only.

Read statically from the source (lazy imports inside functions count too: a circle through a
function-level import is still a circle a reader has to untangle).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "gptforge"


def _modules() -> dict[str, Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            if n.startswith("gptforge"):
                target = _resolve(n)
                if target and target != module:
                    found.add(target)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


def _below(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if m == prefix or m.startswith(prefix + ".")
                  for t in ts if any(t == f or t.startswith(f + ".") for f in forbidden))


def test_nothing_below_the_cli_imports_commands():
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items()
                 if not (m.startswith("gptforge.commands") or m == "gptforge.cli")
                 for t in ts if t.startswith("gptforge.commands"))
    assert not bad, bad


def test_config_reads_no_checkpoints_and_model_io_needs_no_training():
    assert not _below("gptforge.config", ("gptforge.model_io", "gptforge.train", "gptforge.commands"))
    assert not _below("gptforge.model_io", ("gptforge.train", "gptforge.commands"))


def test_the_model_files_are_pure_pytorch():
    shape = {"gptforge.config.schema"}  # the typed shape they are built from
    assert GRAPH["gptforge.model.moe"] <= shape, GRAPH["gptforge.model.moe"]
    assert GRAPH["gptforge.model.gpt"] <= shape | {"gptforge.model.moe"}, GRAPH["gptforge.model.gpt"]


def test_no_import_circles():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_checker_sees_a_circle():
    """The graph reader finds edges through function-level imports (else the tests above could not fail)."""
    assert "gptforge.model_io" in GRAPH["gptforge.commands.common"]
    assert "gptforge.dcp_read" in GRAPH["gptforge.model_io"]
