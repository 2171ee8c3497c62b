"""`gptforge config show` as a file you can edit and load back.

Values are written as the layers give them; a value `resolve` derives (batch sizes, accumulation,
ffn width, padded vocabulary, decay steps...) follows as a `# derived: ...` comment. Loading the
text with `-c` gives the same resolved config, and editing one key (max_steps, hidden_size,
global_batch_size) re-derives everything that depends on it instead of keeping stale values.
"""

from __future__ import annotations

from typing import Any

import yaml

from gptforge.config.schema import Config

HEADER = (
    "# gptforge config show: the config as given; values derived from it follow as `# derived:`\n"
    "# comments. Save it, edit it and run it with -c FILE: derived values are derived again.\n"
)


def _flow(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, sort_keys=False).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def _leaf(key: str, value: Any) -> str:
    return f"{_flow(key)}:" if value is None else f"{_flow(key)}: {_flow(value)}"


def _emit(given: dict, resolved: dict, indent: str, out: list[str]) -> None:
    for key, value in given.items():
        derived = resolved.get(key)
        if isinstance(value, dict) and value and isinstance(derived, dict):
            out.append(f"{indent}{_flow(key)}:")
            _emit(value, derived, indent + "  ", out)
            continue
        line = _leaf(key, value)
        if derived != value:
            line += f"  # derived: {_flow(derived)}"
        out.append(indent + line)


def annotated_yaml(given: Config, resolved: Config) -> str:
    """YAML of `given` with each value `resolved` changed noted as `# derived: <value>`."""
    out: list[str] = []
    g, r = given.to_dict(), resolved.to_dict()
    for section, body in g.items():
        out.append(f"{section}:")
        _emit(body, r[section], "  ", out)
        out.append("")
    return HEADER + "\n".join(out)
