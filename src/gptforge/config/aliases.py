"""Map the reference's older and alternative key layouts onto our canonical one.

PaddleFleetX moved keys between releases (spec §0 and docs/recipes-reference.md): the first
examples nested everything under one `PreTraining:` section whose leaf names alone mattered;
`Engine.*` became `Global.*` in the examples layout, `use_pure_fp16` became
`mix_precision.enable`, batch sizes moved from `Data.batch_size` to `Global`, Adam keys lost
their `adam_` prefix, `Gradclip`, `Eval`, `Quantization` and `Prune` moved under
`Optimizer`, `Offline_Eval` and `Compress`, and the auto-parallel engine spelled a few keys its
own way. Files of every era load as they are: each raw YAML dict is normalised here before it
is merged or validated, and `-o` paths the same way.
"""

from __future__ import annotations

import copy
from typing import Any

from gptforge.config.schema import EngineConfig, ModelConfig
from gptforge.errors import ConfigError

_ENGINE_KEYS = set(EngineConfig.__dataclass_fields__)
_BATCH_KEYS = ("global_batch_size", "local_batch_size", "micro_batch_size")
_OPT_RENAMES = {"adam_beta1": "beta1", "adam_beta2": "beta2", "adam_epsilon": "epsilon"}
# Renames inside one section: (section path, old key) -> new key path (from the root).
_KEY_MOVES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("Engine", "save_load", "save_by_step"): ("Engine", "save_load", "save_steps"),
    ("Engine", "save_load", "save_by_steps"): ("Engine", "save_load", "save_steps"),
    ("Engine", "save_load", "save_by_epoch"): ("Engine", "save_load", "save_epoch"),
    ("Engine", "mix_precision", "init_loss_scaling"): ("Engine", "mix_precision", "scale_loss"),
    ("Engine", "use_recompute"): ("Model", "use_recompute"),  # early auto-parallel examples
    ("Distributed", "seed"): ("Global", "seed"),
    ("Distributed", "virtual_pp_degree"): ("Model", "virtual_pp_degree"),
    ("Optimizer", "lr", "learning_rate"): ("Optimizer", "lr", "max_lr"),  # LinearDecayWithWarmup's peak
    ("Offline_Eval", "ckpt_dir"): ("Engine", "save_load", "ckpt_dir"),
    ("Compress", "Quantization", "use_qat"): ("Compress", "Quantization", "enable"),
    ("Compress", "Quantization", "pretrained"): ("Compress", "pretrained"),  # 2022-11 QAT recipes
}
# Whole sections that moved (old name -> canonical path).
_SECTION_MOVES = {
    "Eval": ("Offline_Eval",),
    "Quantization": ("Compress", "Quantization"),
    "Prune": ("Compress", "Prune"),
    "Fused_Passes": ("FusedPasses",),
    "Fused_passes": ("FusedPasses",),
}
# GPT has no convolutions: these layer types matched nothing in the reference either.
_CONV_LAYER_TYPES = ("Conv2D", "Conv2DTranspose")

# The `PreTraining:` layout (examples/gpt, mid 2022) was flattened by leaf name before use, so
# only the leaf's name decides what it sets.
_PRETRAINING_LEAVES: dict[str, tuple[str, ...]] = {
    **{k: ("Global", k) for k in ("device", "seed", *_BATCH_KEYS)},
    **{k: ("Engine", k) for k in ("max_steps", "num_train_epochs", "accumulate_steps", "logging_freq",
                                  "eval_freq", "eval_iters", "test_iters")},
    "use_pure_fp16": ("Engine", "mix_precision", "enable"),
    **{k: ("Engine", "mix_precision", k) for k in ("scale_loss", "custom_black_list", "custom_white_list")},
    **{k: ("Engine", "save_load", k) for k in ("save_steps", "output_dir", "ckpt_dir")},
    **{k: ("Data", "dataset", k) for k in ("input_dir", "split", "max_seq_len")},
    **{k: ("Model", k) for k in ModelConfig.__dataclass_fields__ if k not in ("name", "module")},
    **{k: ("Distributed", k) for k in ("dp_degree", "mp_degree", "pp_degree")},
    **{k: ("Distributed", "sharding", k) for k in ("sharding_degree", "sharding_stage", "sharding_offload")},
    **{k: ("Optimizer", k) for k in ("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "grad_clip",
                                     "tensor_fusion")},
    **{k: ("Optimizer", "lr", k) for k in ("decay_steps", "warmup_rate", "max_lr", "min_lr")},
    "use_qat": ("Compress", "Quantization", "enable"),
    **{k: ("Compress", "Quantization", k) for k in ("weight_bits", "activation_bits")},
    **{k: ("Profiler", k) for k in ("profiler_log", "detailed")},
}


def _merge_into(dst: dict, key: str, value: Any) -> None:
    if isinstance(value, dict) and isinstance(dst.get(key), dict):
        for k, v in value.items():
            _merge_into(dst[key], k, v)
    else:
        dst[key] = value


def _node(raw: dict, path: tuple[str, ...]) -> dict:
    """The mapping at `path`, created (or a blank `key:` replaced) on the way."""
    node = raw
    for part in path:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    return node


def _get(raw: dict, path: tuple[str, ...]) -> Any:
    node: Any = raw
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set_default(raw: dict, path: tuple[str, ...], value: Any) -> None:
    """Put `value` at `path` unless the canonical key is already there (the canonical spelling wins)."""
    parent = _node(raw, path[:-1])
    if path[-1] not in parent or parent[path[-1]] is None:
        parent[path[-1]] = value


def normalize_path(path: str) -> list[str]:
    """Canonical key path for an `-o` override written in any supported layout."""
    parts = path.split(".")
    if parts[0] == "PreTraining" and len(parts) >= 2 and parts[-1] in _PRETRAINING_LEAVES:
        parts = list(_PRETRAINING_LEAVES[parts[-1]])
    if parts[0] in _SECTION_MOVES:
        parts = [*_SECTION_MOVES[parts[0]], *parts[1:]]
    if parts[:2] == ["Gradclip", "grad_clip"]:
        parts = ["Optimizer", "grad_clip", "clip_norm"]
    elif parts[:1] == ["Gradclip"]:
        parts = ["Optimizer", "grad_clip", *parts[1:]]
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
    if parts == ["Fused", "fused_linear"]:
        parts = ["Model", "fused_linear"]
    moved = _KEY_MOVES.get(tuple(parts))
    return list(moved) if moved else parts


# ------------------------------------------------------------------------- layouts


def _refuse_unsupported(raw: dict) -> None:
    """Recipes of features gptforge does not have stop here, in one line."""
    model = raw.get("Model")
    if isinstance(model, dict) and "moe_configs" in model:
        # An unmerged reference branch's layout (incubate MoE); the merged pretrain_moe keys load.
        raise ConfigError("Model.moe_configs: this MoE layout is not supported; use the pretrain_moe keys "
                          "(Model.num_experts, expert_interval, topk, moe_*; docs/moe.md)")
    engine = raw.get("Engine") or raw.get("Global")
    kd = [k for k in ("distil_weight", "kd_rejection", "T") if isinstance(engine, dict) and k in engine]
    if kd:
        raise ConfigError(f"Engine.{kd[0]}: knowledge distillation is not supported (a distill_* recipe)")
    compress = raw.get("Compress")
    if "Distillation" in raw or (isinstance(compress, dict) and "Distillation" in compress):
        where = "Distillation" if "Distillation" in raw else "Compress.Distillation"
        raise ConfigError(f"{where}: knowledge distillation is not supported; remove the section "
                          "(fine-tune the student with gptforge pretrain -o Compress.pretrained=DIR instead)")


def _mark_auto_layout(raw: dict) -> None:
    """The auto-parallel engine's recipes count sharding inside dp (world = dp x mp x pp);
    mark them so `resolve` maps their degrees onto ours (world = dp x sharding x mp x pp)."""
    model, engine = raw.get("Model"), raw.get("Engine") or raw.get("Global")
    mix = engine.get("mix_precision") if isinstance(engine, dict) else None
    auto = (
        (isinstance(model, dict) and str(model.get("module") or "").endswith("Auto"))
        or (isinstance(engine, dict) and "use_recompute" in engine)  # examples/gpt/auto_parallel, 2022-08
        or (isinstance(mix, dict) and ("use_fp16_guard" in mix or "use_bf16_guard" in mix))
        or any(k in raw for k in ("Tuning", "FusedPasses", "Fused_Passes", "Fused_passes"))
    )
    if auto:
        _set_default(raw, ("Distributed", "sharding_in_dp"), True)


def _pretraining_layout(raw: dict) -> dict:
    """`PreTraining: {...}` (examples/gpt, 2022-07/08): every leaf, however nested, by its name."""
    pre = raw.pop("PreTraining", None)
    if pre is None:
        return raw
    if not isinstance(pre, dict):
        raise ConfigError(f"PreTraining: expected a section (mapping), got {pre!r}")

    def leaves(node: dict, path: str):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{path}.{k}")
            else:
                yield f"{path}.{k}", str(k), v

    out: dict = {}
    for path, leaf, value in leaves(pre, "PreTraining"):
        if leaf == "name":  # the optimizer / schedule names were ignored (always AdamW + cosine)
            continue
        if leaf == "lr":  # a plain number: AdamW at that constant learning rate (early auto-parallel example)
            _node(out, ("Optimizer", "lr")).update(name="Constant", max_lr=value)
            continue
        target = _PRETRAINING_LEAVES.get(leaf)
        if target is None:
            raise ConfigError(f"{path}: unknown key in the PreTraining layout (it sets keys by leaf name; "
                              "see docs/recipes-reference.md)")
        _node(out, target[:-1])[target[-1]] = value
    for section, body in raw.items():  # sections beside PreTraining (none in the reference) win
        if isinstance(body, dict) and isinstance(out.get(section), dict):
            for k, v in body.items():
                _merge_into(out[section], k, v)
        else:
            out[section] = body
    return out


def _moved_sections(raw: dict) -> None:
    """Top-level `Eval`, `Quantization`, `Prune`, `Gradclip` and the auto engine's pass sections."""
    for old, new in _SECTION_MOVES.items():
        body = raw.pop(old, None)
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{old}: expected a section (mapping), got {body!r}")
        if old == "Eval":  # the old examples wrote `None` (a string in YAML) for "not set"
            body = {k: (None if v == "None" else v) for k, v in body.items()}
            ckpt = body.pop("ckpt_dir", None)
            if ckpt is not None:
                _set_default(raw, ("Engine", "save_load", "ckpt_dir"), ckpt)
        target = _node(raw, new)
        for k, v in body.items():
            if k not in target or target[k] is None:
                target[k] = v
    clip = raw.pop("Gradclip", None)
    if isinstance(clip, dict):
        # Old engines always built ClipGradByGlobalNorm from `grad_clip`; `name` was not read.
        if "grad_clip" in clip:
            _set_default(raw, ("Optimizer", "grad_clip", "clip_norm"), clip["grad_clip"])
        _set_default(raw, ("Optimizer", "grad_clip", "name"), "ClipGradByGlobalNorm")
    elif clip is not None:
        _set_default(raw, ("Optimizer", "grad_clip", "clip_norm"), clip)


def _moved_keys(raw: dict) -> None:
    for old, new in _KEY_MOVES.items():
        parent = _get(raw, old[:-1])
        if isinstance(parent, dict) and old[-1] in parent:
            value = parent.pop(old[-1])
            _set_default(raw, new, value)


def _quantization_spellings(raw: dict) -> None:
    q = _get(raw, ("Compress", "Quantization"))
    if not isinstance(q, dict):
        return
    if "channel_wise_abs_max" in q:  # auto-parallel strategy flag
        per_channel = q.pop("channel_wise_abs_max")
        q.setdefault("weight_quantize_type", "channel_wise_abs_max" if per_channel in (True, None) else "abs_max")
    # The examples' QAT section carried `ckpt_dir: None`, which no engine read.
    if q.get("ckpt_dir") in (None, "None"):
        q.pop("ckpt_dir", None)
    types = q.get("quantizable_layer_type")
    if isinstance(types, list):
        q["quantizable_layer_type"] = [t for t in types if t not in _CONV_LAYER_TYPES]


def _split_level_keys(raw: dict) -> None:
    """Old auto base: `Data.collate_fn` / `Data.sample_split` applied to every split."""
    data = raw.get("Data")
    if not isinstance(data, dict):
        return
    for key in ("collate_fn", "sample_split"):
        if key in data:
            value = data.pop(key)
            for split in ("Train", "Eval"):
                _set_default(raw, ("Data", split, key), value)


def normalize_raw(raw: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of one YAML document rewritten into the canonical layout."""
    raw = copy.deepcopy(raw)
    _refuse_unsupported(raw)
    raw = _pretraining_layout(raw)
    _mark_auto_layout(raw)
    _moved_sections(raw)

    glob = raw.get("Global")
    if isinstance(glob, dict):
        moved = {k: glob.pop(k) for k in list(glob) if k in _ENGINE_KEYS}
        if moved:
            engine = raw.setdefault("Engine", {}) or {}
            raw["Engine"] = engine
            for k, v in moved.items():
                _merge_into(engine, k, v)

    _moved_keys(raw)
    _quantization_spellings(raw)

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
    _split_level_keys(raw)

    opt = raw.get("Optimizer")
    if isinstance(opt, dict):
        for old, new in _OPT_RENAMES.items():
            if old in opt:
                opt.setdefault(new, opt.pop(old))
        gc = opt.get("grad_clip")
        if isinstance(gc, (int, float)) and not isinstance(gc, bool):
            opt["grad_clip"] = {"clip_norm": float(gc)}
        if opt.get("name") == "Adam":
            # Where the reference ran with `name: Adam` (2022 engines) it built AdamW regardless.
            opt["name"] = "AdamW"

    fused = raw.pop("Fused", None)
    if isinstance(fused, dict):
        if "tensor_fusion" in fused:
            _set_default(raw, ("Optimizer", "tensor_fusion"), fused.pop("tensor_fusion"))
        if "fused_linear" in fused:  # examples/gpt, 2022-08
            _set_default(raw, ("Model", "fused_linear"), fused.pop("fused_linear"))
        if fused:
            raw["Fused"] = fused  # let validation report what is left
    elif fused is not None:
        raw["Fused"] = fused
    return raw
