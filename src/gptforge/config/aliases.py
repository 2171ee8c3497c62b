"""Map the reference's older and alternative key layouts onto our canonical one.

PaddleFleetX moved keys between releases (spec §0): `Engine.*` became `Global.*` in the
examples layout, `use_pure_fp16` became `mix_precision.enable`, batch sizes moved from
`Data.batch_size` to `Global`, Adam keys lost their `adam_` prefix. Files of every era load
as they are: each raw YAML dict is normalised here before it is merged or validated.
"""

from __future__ import annotations

import copy
from typing import Any

from gptforge.config.schema import EngineConfig

_ENGINE_KEYS = set(EngineConfig.__dataclass_fields__)
_BATCH_KEYS = ("global_batch_size", "local_batch_size", "micro_batch_size")
_OPT_RENAMES = {"adam_beta1": "beta1", "adam_beta2": "beta2", "adam_epsilon": "epsilon"}


def _merge_into(dst: dict, key: str, value: Any) -> None:
    if isinstance(value, dict) and isinstance(dst.get(key), dict):
        for k, v in value.items():
            _merge_into(dst[key], k, v)
    else:
        dst[key] = value


def normalize_path(path: str) -> list[str]:
    """Canonical key path for an `-o` override written in any supported layout."""
    parts = path.split(".")
    if len(parts) >= 2 and parts[0] == "Global" and parts[1] in _ENGINE_KEYS:
        parts = ["Engine", *parts[1:]]
    if parts[:3] == ["Engine", "mix_precision", "use_pure_fp16"]:
        parts = ["Engine", "mix_precision", "enable"]
    if len(parts) == 3 and parts[:2] == ["Data", "batch_size"] and parts[2] in _BATCH_KEYS:
        parts = ["Global", parts[2]]
    if len(parts) == 2 and parts[0] == "Optimizer" and parts[1] in _OPT_RENAMES:
        parts = ["Optimizer", _OPT_RENAMES[parts[1]]]
    if parts == ["Fused", "tensor_fusion"]:
        parts = ["Optimizer", "tensor_fusion"]
    return parts


def normalize_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of one YAML document rewritten into the canonical layout."""
    raw = copy.deepcopy(raw)

    glob = raw.get("Global")
    if isinstance(glob, dict):
        moved = {k: glob.pop(k) for k in list(glob) if k in _ENGINE_KEYS}
        if moved:
            engine = raw.setdefault("Engine", {}) or {}
            raw["Engine"] = engine
            for k, v in moved.items():
                _merge_into(engine, k, v)

    engine = raw.get("Engine")
    if isinstance(engine, dict):
        mp = engine.get("mix_precision")
        if isinstance(mp, dict) and "use_pure_fp16" in mp:
            val = mp.pop("use_pure_fp16")
            mp.setdefault("enable", val)
        if isinstance(mp, dict) and isinstance(mp.get("level"), str):
            mp["level"] = mp["level"].upper()

    data = raw.get("Data")
    if isinstance(data, dict):
        bs = data.pop("batch_size", None)
        if isinstance(bs, dict):
            glob = raw.setdefault("Global", {}) or {}
            raw["Global"] = glob
            for k, v in bs.items():
                glob.setdefault(k, v)
        elif bs is not None:
            data["batch_size"] = bs  # let validation report it
        # Old layout: Data.dataset applied to both train and eval.
        ds = data.pop("dataset", None)
        if isinstance(ds, dict):
            for split in ("Train", "Eval"):
                node = data.setdefault(split, {}) or {}
                data[split] = node
                node_ds = node.setdefault("dataset", {}) or {}
                node["dataset"] = node_ds
                for k, v in ds.items():
                    node_ds.setdefault(k, v)
        elif ds is not None:
            data["dataset"] = ds

    opt = raw.get("Optimizer")
    if isinstance(opt, dict):
        for old, new in _OPT_RENAMES.items():
            if old in opt:
                opt.setdefault(new, opt.pop(old))
        gc = opt.get("grad_clip")
        if isinstance(gc, (int, float)) and not isinstance(gc, bool):
            opt["grad_clip"] = {"clip_norm": float(gc)}

    fused = raw.pop("Fused", None)
    if isinstance(fused, dict) and "tensor_fusion" in fused:
        opt = raw.setdefault("Optimizer", {}) or {}
        raw["Optimizer"] = opt
        opt.setdefault("tensor_fusion", fused["tensor_fusion"])
    elif fused is not None:
        raw["Fused"] = fused
    return raw
