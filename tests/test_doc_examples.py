"""Every fenced shell and Python example in README.md and docs/*.md runs as written.

Each page runs top to bottom in a fresh directory (tests/doc_examples.py says how a page marks a
long example for `make test-all` or one that cannot run here). A failure names the page and line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from doc_examples import COMMAND_LINE, PENDING, PENDING_REASON, Example, examples, pages

PAGES = {str(p.relative_to(p.parents[1] if p.parent.name == "docs" else p.parent)): p for p in pages()}
BLOCK_TIMEOUT_S = 600


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The interpreter running the tests is the one whose `gptforge` a reader installed.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run(ex: Example, cwd: Path, env: dict[str, str]) -> None:
    if ex.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", ex.code]
    else:
        script = cwd / f"_doc_example_{ex.line}.py"
        script.write_text(ex.code, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{ex.where}: example ran past {BLOCK_TIMEOUT_S} s:\n{ex.code}")
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-25:])
        pytest.fail(f"{ex.where}: example exited {r.returncode}:\n{ex.code}\n--- output (tail) ---\n{tail}")


def _run_page(path: Path, tmp_path: Path, with_slow: bool) -> None:
    page = str(path.relative_to(path.parents[1] if path.parent.name == "docs" else path.parent))
    if page in PENDING:
        pytest.skip(f"{page}: {PENDING_REASON}")
    todo = [e for e in examples(path) if e.lang and not e.skip and (with_slow or not e.slow)]
    if not todo:
        pytest.skip("no runnable examples on this page")
    env = _env()
    for ex in todo:
        _run(ex, tmp_path, env)


def test_command_fences_are_tagged_and_skips_say_why():
    bad = []
    for path in pages():
        for ex in examples(path):
            if not ex.lang and not ex.info and any(COMMAND_LINE.match(ln) for ln in ex.code.splitlines()):
                bad.append(f"{ex.where}: untagged fence holds commands (tag it ```bash or ```text)")
            if ex.skip == "?":
                bad.append(f"{ex.where}: `doctest: skip` needs a reason")
    assert not bad, "\n".join(bad)


def test_pending_pages_exist():
    assert set(PAGES) >= PENDING, sorted(PENDING - set(PAGES))


@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_examples_run(page, tmp_path):
    _run_page(PAGES[page], tmp_path, with_slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(p for p, path in PAGES.items() if any(e.slow for e in examples(path))))
def test_page_examples_run_with_slow_ones(page, tmp_path):
    _run_page(PAGES[page], tmp_path, with_slow=True)
