"""Fenced examples of README.md and docs/*.md, as the doc-test runner sees them.

A page's ```bash / ```sh / ```python blocks run in order, in one fresh working directory per
page, with the installed `gptforge` first on PATH: what a reader would type, run as written.
Other fences (```text, ```yaml, ```json, diagrams) are shown, not run.

An HTML comment on the line just above a fence changes how it runs:

- `<!-- doctest: slow -->` runs it only in `make test-all` (blocks after it on the page must not
  need what it makes, or must be slow too);
- `<!-- doctest: skip REASON -->` never runs it; REASON is required (e.g. "needs a GPU",
  "runs the test suite itself");
- `<!-- doctest: needs MODULE -->` runs it only where the Python module MODULE is importable (an
  optional extra that is costly to install, e.g. `llama_cpp`), and skips it, saying so, elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGS = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python", "py": "python"}
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doctest:\s*(?P<kind>slow|skip|needs)\b\s*(?P<reason>.*?)\s*-->\s*$")


@dataclass
class Example:
    page: str          # path relative to the repository root
    line: int          # 1-based line of the opening fence
    lang: str          # "bash" or "python"; "" when the fence is not run
    info: str          # the fence's info string as written
    code: str
    slow: bool = False
    skip: str = ""     # the reason, when skipped

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _importable(module: str) -> bool:
    import importlib.util

    return bool(module) and importlib.util.find_spec(module) is not None


def pages() -> list[Path]:
    """README.md and every docs page."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def examples(path: Path) -> list[Example]:
    """Every fenced block of a page, in order (run or not)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Example] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m["fence"], m["info"].strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        lang = RUN_LANGS.get(info.split()[0].lower(), "") if info else ""
        ex = Example(str(path.relative_to(ROOT)), start + 1, lang, info, "\n".join(body) + "\n")
        d = _DIRECTIVE.match(lines[start - 1]) if start > 0 else None
        if d:
            if d["kind"] == "slow":
                ex.slow = True
            elif d["kind"] == "needs":
                module = d["reason"]  # no module named is reported like a skip without a reason
                ex.skip = "?" if not module else "" if _importable(module) else f"needs the {module} module"
            else:
                ex.skip = d["reason"] or "?"
        out.append(ex)
    return out


# Pages whose examples still use placeholders or files no page makes (issue #17, "Docs that
# run"): reported as skipped, with this reason, until each page is made to run as written. A page
# leaves this list when its examples pass (remove it here; nothing else changes).
PENDING_REASON = "examples not yet runnable as written (placeholders or files the page does not make)"
PENDING: set[str] = set()  # every page runs as written


# Lines that look like commands a reader would type; an untagged fence holding one is a doc bug
# (the runner could not tell it is meant to run).
COMMAND_LINE = re.compile(r"^\s*(\$ )?(gptforge|make|python3?|pip|torchrun|curl|cd|export)\b")
