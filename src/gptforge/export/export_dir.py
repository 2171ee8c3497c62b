"""Export directories as the runtime reads them (`gptforge export --format onnx|torch_export`):
the metadata file, the checks that make a wrong directory a one-line error, the saved config.
`export/` writes them; the inference backends (`ort_backend`) and the loader read them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gptforge.errors import CheckpointError

META_FILE = "gptforge_export.json"  # what an ONNX / torch.export directory holds (format, precision, shapes)


def is_export_dir(path: str | os.PathLike, fmt: str = "onnx") -> bool:
    """Whether `path` is an export directory of format `fmt` (no checks beyond its metadata)."""
    meta = Path(path) / META_FILE
    try:
        return meta.is_file() and json.loads(meta.read_text(encoding="utf-8")).get("format") == fmt
    except (OSError, ValueError):
        return meta.is_file()  # unreadable: `read_export_dir` says why


def read_export_dir(path: str | os.PathLike, fmt: str = "onnx") -> tuple[Path, dict]:
    """(directory, its gptforge_export.json) for an export of format `fmt`, with one-line
    errors for a missing directory, a model directory, another format or a missing model."""
    p = Path(path)
    fix = f"`gptforge export --format {fmt} --ckpt DIR --out {p}`"
    if not p.exists():
        raise CheckpointError(f"{p}: not found; export a model there with {fix}")
    if p.is_file():
        p = p.parent
    meta_path = p / META_FILE
    if not meta_path.is_file():
        what = "a model directory, not an export" if (p / "config.yaml").is_file() or (p / "config.json").is_file() \
            else f"no {META_FILE} here"
        raise CheckpointError(f"{p}: {what}; make one with {fix}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise CheckpointError(f"{meta_path}: unreadable JSON ({e}); re-export with {fix}") from None
    if meta.get("format") != fmt:
        raise CheckpointError(f"{p}: holds a {meta.get('format')!r} export, not {fmt}; make one with {fix}")
    model = p / ("model.onnx" if fmt == "onnx" else "model.pt2")
    if not model.is_file():
        raise CheckpointError(f"{p}: {model.name} is missing; re-export with {fix}")
    return p, meta


def load_export_config(path: str | os.PathLike, config_file: str | None = None, overrides=()):
    """The export's config.yaml, then a `-c` file (its Model shape keys ignored), then `-o`."""
    from gptforge.config import ARCH_KEYS, apply_overrides, build_config, load_raw, resolve
    from gptforge.config.loader import deep_merge
    from gptforge.config.resolve import apply_preset

    p = Path(path)
    raw = load_raw(p / "config.yaml") if (p / "config.yaml").is_file() else {}
    if config_file:
        file_raw = load_raw(config_file)
        if isinstance(file_raw.get("Model"), dict):
            file_raw["Model"] = {k: v for k, v in file_raw["Model"].items() if k not in ARCH_KEYS and k != "preset"}
        raw = deep_merge(raw, file_raw)
    raw = apply_overrides(raw, overrides)
    return resolve(build_config(apply_preset(raw)))
