"""Key listings generated from the schema (used by `gptforge config keys` and docs/config.md)."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from gptforge.config import schema
from gptforge.errors import ConfigError


def _field_comments(cls: type) -> dict[str, str]:
    """`name: type = default  # comment` → {name: comment}, read from the schema source."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+):[^#]*#\s*(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _type_str(tp) -> str:
    return str(tp).replace("typing.", "").replace("NoneType", "None").replace("<class '", "").replace("'>", "")


def iter_keys(cls: type = schema.Config, prefix: str = ""):
    """Yield (key path, type, default, comment) for every leaf key."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from iter_keys(tp, path + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        yield path, _type_str(tp), default, comments.get(f.name, "")


def keys_table(section: str | None = None) -> str:
    rows = [r for r in iter_keys() if section is None or r[0].split(".")[0] == section]
    if not rows:
        raise ConfigError(f"{section}: unknown section; choose from {', '.join(schema.SECTIONS)}")
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for path, tp, default, comment in rows:
        tp, comment = tp.replace("|", "or"), comment.replace("|", "\\|")
        lines.append(f"| `{path}` | {tp} | `{default!r}` | {comment} |")
    return "\n".join(lines)
