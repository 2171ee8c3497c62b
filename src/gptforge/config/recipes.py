"""The YAML recipes shipped inside the package (`gptforge/recipes/*.yaml`) and how `-c` finds them.

`-c` takes a file path first. When no such file exists, a bare recipe name
(`pretrain_gpt_tiny_cpu`, with or without `.yaml`) or the spelling older docs use,
`configs/<name>.yaml`, names the packaged recipe of that stem, so every recipe works from a
pip install and from any directory. `_base_` entries resolve the same way.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gptforge.errors import ConfigError

SUFFIXES = (".yaml", ".yml")
# Directory names under which a missing file still means "the packaged recipe of this stem":
# the repository kept its recipes in configs/ before they became package data.
LEGACY_DIRS = ("configs", "recipes")


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    description: str


def recipe_dir() -> Path:
    """The directory holding the packaged recipes."""
    return Path(str(resources.files("gptforge") / "recipes"))


def recipe_names() -> list[str]:
    d = recipe_dir()
    return sorted(p.stem for p in d.iterdir() if p.suffix in SUFFIXES) if d.is_dir() else []


def recipe_path(name: str) -> Path | None:
    """The packaged recipe called `name` (a stem, `.yaml` optional), or None."""
    stem = name[: -len(Path(name).suffix)] if Path(name).suffix in SUFFIXES else name
    for suffix in SUFFIXES:
        p = recipe_dir() / f"{stem}{suffix}"
        if p.is_file():
            return p
    return None


def description(path: Path) -> str:
    """A recipe's one-line description: its first comment line."""
    for line in path.read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            return s.lstrip("#").strip()
        break
    return ""


def list_recipes() -> list[Recipe]:
    """Every packaged recipe with its description, sorted by name."""
    out = []
    for name in recipe_names():
        p = recipe_path(name)
        assert p is not None
        out.append(Recipe(name, p, description(p)))
    return out


def packaged_fallback(spec: str) -> Path | None:
    """The packaged recipe a missing path stands for: a bare name or `configs/<name>.yaml`."""
    p = Path(spec)
    if str(p.parent) not in ("", ".") and p.parent.name not in LEGACY_DIRS:
        return None
    return recipe_path(p.name)


def locate(spec: str | os.PathLike, what: str = "config file") -> Path:
    """The YAML file `-c SPEC` means: an existing path, else the packaged recipe it names."""
    p = Path(spec).expanduser()
    if p.exists():
        return p
    found = packaged_fallback(str(spec))
    if found is not None:
        return found
    stem = p.stem if p.suffix in SUFFIXES else p.name
    if recipe_path(stem) is not None:
        raise ConfigError(f"{spec}: {what} not found; for the packaged recipe of that name use -c {stem}")
    match = difflib.get_close_matches(stem, recipe_names(), n=1, cutoff=0.6)
    hint = f" (did you mean -c {match[0]}?)" if match else ""
    raise ConfigError(f"{spec}: {what} not found, nor a packaged recipe of that name{hint}; "
                      "`gptforge config list` shows the packaged recipes")
