"""`gptforge docs [PAGE]`: the documentation pages, shipped with gptforge as package data.

    gptforge docs                 # the pages, one line each
    gptforge docs generate        # print docs/generate.md
    gptforge docs serve --path    # where that file is

A pip-installed gptforge has no checkout to read docs/ from: the wheel carries the pages
(`gptforge/docs/*.md`, a link to the repository's docs/ in the sources).
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__
    p.add_argument("page", nargs="?", metavar="PAGE", help="a verb (generate, serve, ...) or another page's name "
                   "(cli, config, install, ...); without it, list the pages")
    p.add_argument("--path", action="store_true", help="print the page's file path instead of its text")


def pages_dir() -> Path:
    """The directory of the shipped pages (`gptforge/docs` in a wheel and in the sources)."""
    from importlib.resources import files

    return Path(str(files("gptforge") / "docs"))


def pages() -> dict[str, Path]:
    d = pages_dir()
    return {f.stem: f for f in sorted(d.glob("*.md"))} if d.is_dir() else {}


def _title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def run(args: argparse.Namespace) -> int:
    found = pages()
    if not found:
        raise UsageError(f"no documentation pages found in {pages_dir()} (this installation was built without them)")
    if args.page is None:
        width = max(len(n) for n in found)
        for name, path in found.items():
            print(f"{name:<{width}}  {_title(path)}")
        print("\nPrint one with `gptforge docs PAGE`.")
        return 0
    name = args.page[:-3] if args.page.endswith(".md") else args.page
    name = name.removeprefix("docs/")
    if name not in found:
        match = difflib.get_close_matches(name, list(found), n=1, cutoff=0.5)
        hint = f" (did you mean {match[0]}?)" if match else ""
        raise UsageError(f"no page {args.page!r}{hint}; `gptforge docs` lists them")
    if args.path:
        print(found[name])
    else:
        print(found[name].read_text(encoding="utf-8"), end="")
    return 0
