"""Load, merge, override, validate and derive a `Config`.

Pipeline: YAML file (with `_base_` inheritance, each document normalised by `aliases`) →
optional checkpoint config underneath → `-o Section.key=value` overrides → typed dataclasses
(unknown keys and wrong types raise `ConfigError` naming the key path and the closest valid
key) → `resolve` derives what the reference derives (batch sizes, accumulation, ffn width,
padded vocab, recompute defaults).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from gptforge.config.aliases import normalize_path, normalize_raw
from gptforge.config.recipes import locate, packaged_fallback
from gptforge.config.schema import Config, DatasetConfig, ModelConfig
from gptforge.errors import ConfigError

# Model keys that describe the *shape* of the weights: a checkpoint's values win over a -c file.
ARCH_KEYS = (
    "vocab_size",
    "vocab_size_divisible_unit",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "head_dim",
    "ffn_hidden_size",
    "layer_num_heads",
    "layer_ffn_sizes",
    "max_position_embeddings",
    "layer_norm_epsilon",
    # MoE routing: a checkpoint computes as it was trained
    "num_experts",
    "expert_interval",
    "topk",
    "moe_gate",
    "moe_use_residual",
    "moe_train_capacity_factor",
    "moe_eval_capacity_factor",
    "moe_min_capacity",
    "moe_token_dropping",
)


# Keys that hold filesystem paths, with the words they accept that are not paths. A run reads
# them relative to its working directory; a saved config.yaml stores them absolute
# (`absolute_paths`), so nothing in a model directory depends on where its run was started.
# (Profiler.profiler_log is relative to the run's output directory, not a path of its own.)
PATH_KEYS: dict[str, tuple[str, ...]] = {
    "Data.tokenizer": ("gpt2", "gpt", "gpt-2"),
    "Data.Train.dataset.input_dir": ("builtin",),
    "Data.Eval.dataset.input_dir": ("builtin",),
    "Data.Test.dataset.input_dir": ("builtin",),
    "Engine.save_load.output_dir": (),
    "Engine.save_load.ckpt_dir": ("auto",),
    "Offline_Eval.eval_path": (),
    "Offline_Eval.output": (),
    "Compress.pretrained": (),
    "Inference.model_dir": (),
    "Inference.TensorRT.shape_range_info_filename": (),
}


def _at(raw: dict, key: str) -> Any:
    """The value at dotted `key` ("Data.tokenizer") of a raw dict, or None."""
    return _get(raw, *key.split("."))


def _with(raw: dict, key: str, value: Any, drop: bool = False) -> dict:
    """A copy of `raw` with `key` set to `value` (or removed), copying only the sections on its path."""
    head, _, rest = key.partition(".")
    out = dict(raw)
    if not rest:
        if drop:
            out.pop(head, None)
        else:
            out[head] = value
        return out
    child = out.get(head)
    out[head] = _with(child if isinstance(child, dict) else {}, rest, value, drop)
    return out


def _relative_path_value(raw: dict, key: str) -> str | None:
    """The value of path key `key` when it is a relative path (not a keyword, not absolute)."""
    v = _at(raw, key)
    if not isinstance(v, str) or not v.strip() or v.strip().lower() in PATH_KEYS[key]:
        return None
    return None if os.path.isabs(os.path.expanduser(v)) else v


def absolute_paths(raw: dict[str, Any], base: str | os.PathLike | None = None) -> dict[str, Any]:
    """`raw` with every relative `PATH_KEYS` value made absolute against `base` (default: the cwd)."""
    base = os.path.abspath(base if base is not None else os.getcwd())
    for key in PATH_KEYS:
        v = _at(raw, key)
        if isinstance(v, str) and v.strip() and v.strip().lower() not in PATH_KEYS[key]:
            raw = _with(raw, key, os.path.normpath(os.path.join(base, os.path.expanduser(v))))
    return raw


# ----------------------------------------------------------------------------- raw YAML


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read one YAML mapping; errors name the file (and line for syntax errors)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: config file not found")
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, expected a YAML file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}:{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def deep_merge(base: dict, top: dict) -> dict:
    """Recursive dict merge: values in `top` win; nested mappings merge key by key."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_raw(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML file with its `_base_` chain resolved (paths relative to the including file).

    `path` may also name a packaged recipe (`pretrain_gpt_tiny_cpu`, `configs/<name>.yaml`);
    so may a `_base_` entry that is not a file next to the including one.
    """
    p = (locate(path) if not _seen else Path(path)).resolve()
    if p in _seen:
        chain = " -> ".join(str(s) for s in (*_seen, p))
        raise ConfigError(f"{p}: _base_ inheritance loops ({chain})")
    data = read_yaml(p)
    bases = data.pop("_base_", None)
    merged: dict[str, Any] = {}
    if bases:
        for b in [bases] if isinstance(bases, str) else list(bases):
            if not isinstance(b, str):
                raise ConfigError(f"{p}: _base_ must be a file path or a list of paths, got {b!r}")
            bp = Path(b) if os.path.isabs(b) else p.parent / b
            if not bp.exists():
                bp = packaged_fallback(b)
                if bp is None:
                    raise ConfigError(f"{p}: _base_ file not found: {b} (nor a packaged recipe of that name; "
                                      "`gptforge config list` shows them)")
            merged = deep_merge(merged, load_raw(bp, (*_seen, p)))
    data = normalize_raw(data)
    return deep_merge(merged, apply_overrides(data, preset_fills(data, merged)))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`Section.key=value` → (canonical key path, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected Section.key=value")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: bad key path {key!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return normalize_path(key), parsed


def apply_overrides(raw: dict, overrides: typing.Iterable[str]) -> dict:
    """Apply `-o` overrides to a raw dict (copying the sections it touches)."""
    raw = dict(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return raw


# ------------------------------------------------------------------------ typed build


def _suggest(name: str, options: typing.Iterable[str], prefix: str) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean {prefix}{match[0]}?)" if match else ""


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return True, args[0]
    return False, tp


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    optional, inner = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise _Blank()
    tp = inner
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a section (mapping), got {value!r}")
        return _build(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                as_float = float(value)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):  # '949,50,1' style
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            if item_tp in (int, str, float) and not isinstance(value, dict):
                value = [value]
            else:
                raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): _coerce(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")  # pragma: no cover


class _Blank(Exception):
    """A blank value for a non-optional key: the default applies (reference semantics)."""


def _build(cls: type, data: dict, path: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            sub = f"{path}." if path else ""
            what = "section" if not path else "key"
            raise ConfigError(f"{sub}{key}: unknown {what}{_suggest(str(key), names, sub)}")
        try:
            kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
        except _Blank:
            continue
    return cls(**kwargs)


def build_config(raw: dict[str, Any]) -> Config:
    """Typed `Config` from a canonical raw dict (no derivation)."""
    raw = dict(raw)
    raw.pop("_base_", None)
    return _build(Config, raw, "")


# --------------------------------------------------------------------------- derive


def _preset_shape(name: Any) -> dict[str, Any]:
    from gptforge.model.presets import PRESETS

    name = str(name)
    if name not in PRESETS:
        raise ConfigError(f"Model.preset: unknown preset {name!r}{_suggest(name, PRESETS, '')}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]


def _get(raw: dict, *path: str) -> Any:
    node: Any = raw
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def preset_fills(layer: dict[str, Any], below: dict[str, Any], keep: typing.Container[str] = ()) -> list[str]:
    """What naming `Model.preset` in one config layer (a YAML document, the -o overrides) sets,
    as `Section.key=value` overrides to apply over that layer.

    The preset's shape replaces the shape the layers below set, except the keys this layer sets
    itself (and `keep`: a checkpoint's shape). The vocabulary is left blank for `apply_preset`,
    which matches it to the tokenizer. Sequence lengths from below that exceed the preset's
    positions come down to them, so `-o Model.preset=tiny` works over any recipe.
    """
    model = layer.get("Model")
    if not isinstance(model, dict) or not model.get("preset"):
        return []
    shape = _preset_shape(model["preset"])
    fills = [f"Model.{key}=" + ("" if key == "vocab_size" else str(value))
             for key, value in shape.items() if key not in keep and model.get(key) is None]
    positions = model.get("max_position_embeddings") or shape.get("max_position_embeddings")
    if positions is None or "max_position_embeddings" in keep:
        return fills
    for split in ("Train", "Eval", "Test"):
        if _get(layer, "Data", split, "dataset", "max_seq_len") is not None:
            continue  # this layer's own value: check_train_shapes judges it
        seq = _get(below, "Data", split, "dataset", "max_seq_len")
        seq = DatasetConfig().max_seq_len if seq is None else seq
        if isinstance(seq, int) and seq > int(positions):
            fills.append(f"Data.{split}.dataset.max_seq_len={int(positions)}")
    return fills


def apply_preset(raw: dict[str, Any]) -> dict[str, Any]:
    """Expand `Model.preset` in a merged raw dict: preset shape values fill keys no layer set.

    A blank vocabulary takes the preset's; with `Data.tokenizer: gpt2` (the CPU recipes) it is at
    least GPT-2's 50257 tokens: `tiny` and `mini` carry the size of a trained tokenizer
    (`gptforge tokenizer train`). A blank `Data.tokenizer` may still mean a checkpoint's own, so
    there the preset's size stays and the trainer names `-o Model.vocab_size` if GPT-2's ids
    do not fit.
    """
    model = raw.get("Model")
    if not isinstance(model, dict) or not model.get("preset"):
        return raw
    from gptforge.model.presets import GPT2_VOCAB_SIZE

    shape = _preset_shape(model["preset"])
    filled = {**shape, **{k: v for k, v in model.items() if v is not None}}
    if model.get("vocab_size") is None and "vocab_size" in shape:
        tokenizer = _get(raw, "Data", "tokenizer")
        if tokenizer is not None and str(tokenizer).lower() in ("gpt2", "gpt", "gpt-2"):
            filled["vocab_size"] = max(shape["vocab_size"], GPT2_VOCAB_SIZE)
    return {**raw, "Model": filled}


def world_size_from_env() -> int:
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def resolve_model(m: ModelConfig, mp_degree: int = 1) -> None:
    """Fill derived model fields in place and check the shape is buildable."""
    for key in ("hidden_size", "num_layers", "num_attention_heads", "vocab_size", "max_position_embeddings"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"Model.{key}: must be > 0, got {getattr(m, key)}")
    if m.head_dim is None:
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"Model.num_attention_heads: {m.num_attention_heads} does not divide Model.hidden_size "
                f"{m.hidden_size}; change one, or set Model.head_dim"
            )
        m.head_dim = m.hidden_size // m.num_attention_heads
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = 4 * m.hidden_size
    unit = max(1, m.vocab_size_divisible_unit) * max(1, mp_degree)
    if m.vocab_size % unit:
        m.vocab_size = (m.vocab_size + unit - 1) // unit * unit
    for key, default in (("layer_num_heads", m.num_attention_heads), ("layer_ffn_sizes", m.ffn_hidden_size)):
        vals = getattr(m, key)
        if vals is not None:
            if len(vals) != m.num_layers:
                raise ConfigError(f"Model.{key}: has {len(vals)} entries, expected Model.num_layers={m.num_layers}")
            if any(v <= 0 for v in vals):
                raise ConfigError(f"Model.{key}: every entry must be > 0, got {vals}")
            if all(v == default for v in vals):
                setattr(m, key, None)
    if m.use_recompute and m.recompute_granularity is None:
        m.recompute_granularity = "full"
    if m.recompute_granularity is not None and m.recompute_granularity not in ("full", "full_attn", "core_attn"):
        raise ConfigError(
            f"Model.recompute_granularity: {m.recompute_granularity!r} is not one of full, full_attn, core_attn"
            f"{_suggest(m.recompute_granularity, ('full', 'full_attn', 'core_attn'), '')}"
        )
    layers = sorted(set(m.no_recompute_layers or []))
    bad = [i for i in layers if not 0 <= i < m.num_layers]
    if bad:
        raise ConfigError(f"Model.no_recompute_layers: {bad} outside [0, {m.num_layers})")
    m.no_recompute_layers = layers
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        p = getattr(m, key)
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"Model.{key}: must be in [0, 1), got {p}")
    _resolve_moe(m)


MOE_GATES = ("switch", "gshard", "naive")


def _resolve_moe(m: ModelConfig) -> None:
    counts = list(m.num_experts or [1])
    if any(n < 1 for n in counts):
        raise ConfigError(f"Model.num_experts: every entry must be >= 1, got {counts}")
    if m.expert_interval < 1:
        raise ConfigError(f"Model.expert_interval: must be >= 1, got {m.expert_interval}")
    n_moe = m.num_layers // m.expert_interval
    if len(counts) not in (1, n_moe):
        raise ConfigError(f"Model.num_experts: {len(counts)} values; give one, or one per MoE layer "
                          f"({n_moe}: num_layers {m.num_layers} / expert_interval {m.expert_interval})")
    if m.enable_expert_tensor_parallelism:
        raise ConfigError("Model.enable_expert_tensor_parallelism: splitting experts over mp is not supported; "
                          "set it to false (experts are split over Distributed.ep_degree instead)")
    if m.moe_gate is None:
        m.moe_gate = "gshard" if m.topk == 2 else "switch"
    if m.moe_gate not in MOE_GATES:
        raise ConfigError(f"Model.moe_gate: {m.moe_gate!r} is not one of {', '.join(MOE_GATES)}"
                          f"{_suggest(m.moe_gate, MOE_GATES, '')}")
    want = {"switch": (1,), "gshard": (2,)}.get(m.moe_gate)
    if want and m.topk not in want:
        raise ConfigError(f"Model.topk: the {m.moe_gate} gate routes each token to {want[0]} expert(s), got "
                          f"topk={m.topk}; set topk={want[0]} or Model.moe_gate=naive")
    if not 1 <= m.topk <= max(counts) and max(counts) > 1:
        raise ConfigError(f"Model.topk: must be in [1, num_experts={max(counts)}], got {m.topk}")
    for key in ("moe_train_capacity_factor", "moe_eval_capacity_factor"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"Model.{key}: must be > 0, got {getattr(m, key)}")
    if m.moe_min_capacity < 0:
        raise ConfigError(f"Model.moe_min_capacity: must be >= 0, got {m.moe_min_capacity}")


def resolve_layout_keys(cfg: Config) -> None:
    """Keys of older / alternative reference layouts, turned into their canonical meaning in place:
    recompute layer lists and names, the auto-parallel degrees, resume switches
    (docs/recipes-reference.md)."""
    m = cfg.Model
    if m.recompute_granularity == "only_attn":
        m.recompute_granularity = "full_attn"  # the 2022 name: recompute the whole attention sub-layer
    if m.recompute_layers is not None or m.recompute_start_layer is not None:
        # Old layouts listed the layers TO recompute; the reference later inverted this into
        # no_recompute_layers, which is what the model code reads.
        if m.no_recompute_layers:
            raise ConfigError("Model.recompute_layers / recompute_start_layer: set either these or "
                              "Model.no_recompute_layers, not both")
        if m.recompute_layers is not None and m.recompute_start_layer is not None:
            raise ConfigError("Model.recompute_layers: set either recompute_layers or recompute_start_layer, not both")
        layers = list(range(m.num_layers))
        if m.recompute_layers:
            bad = [i for i in m.recompute_layers if not 0 <= i < m.num_layers]
            if bad:
                raise ConfigError(f"Model.recompute_layers: {bad} outside [0, {m.num_layers})")
            chosen = set(m.recompute_layers)
        elif m.recompute_start_layer is not None:
            if not 0 <= m.recompute_start_layer <= m.num_layers:
                raise ConfigError(f"Model.recompute_start_layer: must be in [0, {m.num_layers}], got {m.recompute_start_layer}")
            chosen = set(range(m.recompute_start_layer, m.num_layers))
        else:
            chosen = set(layers)  # blank: every layer
        m.no_recompute_layers = [i for i in layers if i not in chosen]
        m.recompute_layers = m.recompute_start_layer = None
    d = cfg.Distributed
    if d.sharding_in_dp:
        sh = d.sharding.sharding_degree
        if d.dp_degree is not None and sh > 1:
            if d.dp_degree % sh:
                raise ConfigError(f"Distributed.dp_degree: {d.dp_degree} is not divisible by sharding_degree {sh} "
                                  "(auto-parallel recipes shard inside the data-parallel ranks)")
            d.dp_degree //= sh
        d.sharding_in_dp = False  # applied: dp_degree now counts data-parallel replicas only
    if not cfg.Engine.save_load.load_meta_state:
        raise ConfigError("Engine.save_load.load_meta_state: False (restore weights and optimizer but restart the "
                          "step count) is not supported; resume fully, or start from the weights with "
                          "-o Compress.pretrained=DIR")


def resolve_finetune_keys(cfg: Config) -> None:
    """The fine-tuning recipes' keys (`gptforge finetune`): a GLUE split name where pretraining
    has split weights, the fractional warmup of LinearDecayWithWarmup, the epoch run mode."""
    for split in ("Train", "Eval", "Test"):
        ds = getattr(cfg.Data, split).dataset
        key = f"Data.{split}.dataset.split"
        if isinstance(ds.split, (int, float)) and not isinstance(ds.split, bool):
            ds.split = [ds.split]
        if isinstance(ds.split, str) and ("," in ds.split or ds.split.strip().isdigit()):
            ds.split = [part.strip() for part in ds.split.split(",") if part.strip()]
        if isinstance(ds.split, list):
            try:
                ds.split = [int(float(w)) for w in ds.split]
            except (TypeError, ValueError):
                raise ConfigError(f"{key}: expected three weights like [949, 50, 1] or a split name "
                                  f"like train / dev, got {ds.split!r}") from None
        elif not isinstance(ds.split, str) or not ds.split.strip():
            raise ConfigError(f"{key}: expected three weights like [949, 50, 1] or a split name like train / dev, "
                              f"got {ds.split!r}")
        if ds.max_length is not None and ds.max_length <= 0:
            raise ConfigError(f"Data.{split}.dataset.max_length: must be > 0, got {ds.max_length}")
    lr = cfg.Optimizer.lr
    if lr.warmup is not None:
        if lr.warmup < 0:
            raise ConfigError(f"Optimizer.lr.warmup: must be >= 0, got {lr.warmup}")
        # LinearDecayWithWarmup: a float below 1 is a fraction of the total steps, else a step count.
        if lr.warmup < 1:
            lr.warmup_rate = float(lr.warmup)
        elif lr.warmup_steps is None:
            lr.warmup_steps = int(lr.warmup)
    e = cfg.Engine
    if e.run_mode not in ("step", "epoch"):
        raise ConfigError(f"Engine.run_mode: must be step or epoch, got {e.run_mode!r}")
    # Export/inference recipes write -1 for every count they never use (auto/export_gpt_fp16_single_card).
    if e.run_mode == "epoch" and e.num_train_epochs < 1:
        raise ConfigError(f"Engine.num_train_epochs: must be >= 1, got {e.num_train_epochs}")
    if e.run_mode == "epoch" and e.save_load.save_epoch < 1:
        raise ConfigError(f"Engine.save_load.save_epoch: must be >= 1, got {e.save_load.save_epoch}")
    if cfg.Model.num_classes is not None and cfg.Model.num_classes < 1:
        raise ConfigError(f"Model.num_classes: must be >= 1, got {cfg.Model.num_classes}")


def check_train_length(cfg: Config) -> None:
    """A step-driven training run needs a step count (`max_steps: -1` only means something with
    `run_mode: epoch`, or in recipes that never train)."""
    e = cfg.Engine
    if e.run_mode == "step" and e.max_steps < 0:
        raise ConfigError(f"Engine.max_steps: {e.max_steps} needs Engine.run_mode=epoch (length from "
                          "num_train_epochs); give a step count, e.g. -o Engine.max_steps=1000")
    for split in ("Train", "Eval"):
        ds = getattr(cfg.Data, split).dataset
        if isinstance(ds.split, str):
            raise ConfigError(f"Data.{split}.dataset.split: {ds.split!r} names a fine-tuning split; pretraining "
                              "splits one corpus by weights like [949, 50, 1]")
    sampler, g = cfg.Data.Train.sampler, cfg.Global
    if cfg.Data.Train.dataset.name == "GPTDataset" and sampler.batch_size not in (None, g.local_batch_size):
        # 2022-09 gpt_base.yaml took the per-rank batch from the sampler; every later layout from Global.
        raise ConfigError(f"Data.Train.sampler.batch_size: {sampler.batch_size} disagrees with "
                          f"Global.local_batch_size {g.local_batch_size}; pretraining takes the batch from "
                          f"Global: set -o Global.local_batch_size={sampler.batch_size} (or drop the sampler's)")


def resolve(cfg: Config, world_size: int | None = None) -> Config:
    """Derive what the reference derives; raise ConfigError on inconsistent values."""
    resolve_layout_keys(cfg)
    d = cfg.Distributed
    for key in ("mp_degree", "pp_degree"):
        if getattr(d, key) < 1:
            raise ConfigError(f"Distributed.{key}: must be >= 1, got {getattr(d, key)}")
    if d.sharding.sharding_degree < 1:
        raise ConfigError(f"Distributed.sharding.sharding_degree: must be >= 1, got {d.sharding.sharding_degree}")
    if d.sharding.sharding_stage not in (1, 2, 3):
        raise ConfigError(f"Distributed.sharding.sharding_stage: must be 1, 2 or 3, got {d.sharding.sharding_stage}")
    world = world_size if world_size is not None else world_size_from_env()
    others = d.mp_degree * d.pp_degree * d.sharding.sharding_degree
    if d.dp_degree is None:
        d.dp_degree = max(1, world // others)
    elif d.dp_degree < 1:
        raise ConfigError(f"Distributed.dp_degree: must be >= 1, got {d.dp_degree}")
    data_world = d.dp_degree * d.sharding.sharding_degree

    g = cfg.Global
    for key in ("global_batch_size", "local_batch_size", "micro_batch_size"):
        v = getattr(g, key)
        if v is not None and v <= 0:
            raise ConfigError(f"Global.{key}: must be > 0, got {v}")
    if g.global_batch_size is not None and g.local_batch_size is not None:
        if g.global_batch_size != g.local_batch_size * data_world:
            raise ConfigError(
                f"Global.global_batch_size: {g.global_batch_size} != Global.local_batch_size "
                f"{g.local_batch_size} x data-parallel world {data_world} (dp_degree x sharding_degree); "
                "set only one of them"
            )
    elif g.global_batch_size is not None:
        if g.global_batch_size % data_world:
            raise ConfigError(
                f"Global.global_batch_size: {g.global_batch_size} is not divisible by the data-parallel "
                f"world {data_world} (dp_degree x sharding_degree)"
            )
        g.local_batch_size = g.global_batch_size // data_world
    else:
        if g.local_batch_size is None:
            g.local_batch_size = g.micro_batch_size or 1
        g.global_batch_size = g.local_batch_size * data_world
    if g.micro_batch_size is None:
        g.micro_batch_size = g.local_batch_size
    if g.local_batch_size % g.micro_batch_size:
        raise ConfigError(
            f"Global.micro_batch_size: {g.micro_batch_size} does not divide Global.local_batch_size "
            f"{g.local_batch_size}"
        )

    e = cfg.Engine
    e.accumulate_steps = g.local_batch_size // g.micro_batch_size
    if e.test_iters is None:
        e.test_iters = 10 * e.eval_iters
    if e.max_steps < -1:
        raise ConfigError(f"Engine.max_steps: must be >= 0 (or -1: derived from epochs / unused), got {e.max_steps}")
    if e.logging_freq < 1:
        raise ConfigError(f"Engine.logging_freq: must be >= 1, got {e.logging_freq}")
    if e.save_load.save_steps is not None and e.save_load.save_steps <= 0:
        e.save_load.save_steps = None
    bad = [t for t in e.trackers if t not in ("tensorboard", "wandb", "mlflow")]
    if bad:
        raise ConfigError(f"Engine.trackers: unknown tracker {bad[0]!r}; choose from tensorboard, wandb, mlflow")
    if e.max_time is not None and not e.max_time > 0:
        raise ConfigError(f"Engine.max_time: {e.max_time} must be a number of seconds > 0 (or unset)")
    if e.on_nonfinite not in ("stop", "skip"):
        raise ConfigError(f"Engine.on_nonfinite: must be stop or skip, got {e.on_nonfinite!r}")
    mp = e.mix_precision
    dtype_aliases = {"float16": "float16", "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
    if mp.dtype not in dtype_aliases:
        raise ConfigError(f"Engine.mix_precision.dtype: must be float16 or bfloat16, got {mp.dtype!r}")
    mp.dtype = dtype_aliases[mp.dtype]
    mp.level = mp.level.upper()
    if mp.level not in ("O1", "O2"):
        raise ConfigError(f"Engine.mix_precision.level: must be O1 or O2, got {mp.level!r}")

    resolve_finetune_keys(cfg)
    lr = cfg.Optimizer.lr
    if lr.decay_steps is None or lr.decay_steps <= 0:
        lr.decay_steps = None if e.max_steps < 0 else max(1, e.max_steps)
    if lr.max_lr < 0 or lr.min_lr < 0:
        raise ConfigError("Optimizer.lr.max_lr / min_lr: must be >= 0")
    if not 0.0 <= lr.warmup_rate <= 1.0:
        raise ConfigError(f"Optimizer.lr.warmup_rate: must be in [0, 1], got {lr.warmup_rate}")
    if cfg.Optimizer.grad_clip.clip_norm < 0:
        raise ConfigError(f"Optimizer.grad_clip.clip_norm: must be >= 0, got {cfg.Optimizer.grad_clip.clip_norm}")

    resolve_model(cfg.Model, d.mp_degree)
    m = cfg.Model
    if d.mp_degree > 1 and m.num_attention_heads % d.mp_degree:
        raise ConfigError(
            f"Distributed.mp_degree: {d.mp_degree} does not divide Model.num_attention_heads {m.num_attention_heads}"
        )

    for split in ("Train", "Eval", "Test"):
        ds = getattr(cfg.Data, split).dataset
        if isinstance(ds.split, list) and (len(ds.split) != 3 or any(w < 0 for w in ds.split) or sum(ds.split) <= 0):
            raise ConfigError(
                f"Data.{split}.dataset.split: expected three non-negative weights like [949, 50, 1], got {ds.split}"
            )
        if ds.max_seq_len <= 0:
            raise ConfigError(f"Data.{split}.dataset.max_seq_len: must be > 0, got {ds.max_seq_len}")
    q = cfg.Compress.Quantization
    for key in ("weight_bits", "activation_bits"):
        if not 2 <= getattr(q, key) <= 16:
            raise ConfigError(f"Compress.Quantization.{key}: must be in [2, 16], got {getattr(q, key)}")
    oe = cfg.Offline_Eval
    if oe.lambada_split not in ("reference", "lm_eval"):
        raise ConfigError(f"Offline_Eval.lambada_split: must be reference or lm_eval, got {oe.lambada_split!r}"
                          f"{_suggest(oe.lambada_split, ('reference', 'lm_eval'), '')}")
    p = cfg.Compress.Prune
    if not 0.0 <= p.ratio < 1.0:
        raise ConfigError(f"Compress.Prune.ratio: must be in [0, 1), got {p.ratio}")
    p.head_ratio = p.ratio if p.head_ratio is None else p.head_ratio
    p.ffn_ratio = p.ratio if p.ffn_ratio is None else p.ffn_ratio
    return cfg


def check_distributed(cfg: Config, world_size: int | None = None) -> None:
    """Checks a training launch needs: the degrees fit the processes torchrun started, and the
    combination is one gptforge's torch.distributed engine runs (docs/distributed.md)."""
    d, m = cfg.Distributed, cfg.Model
    world = world_size if world_size is not None else world_size_from_env()
    sh = d.sharding.sharding_degree
    dp, others = d.dp_degree or 1, d.mp_degree * d.pp_degree * sh
    if world % others:
        named = {"mp_degree": d.mp_degree, "pp_degree": d.pp_degree, "sharding.sharding_degree": sh}
        keys = " x ".join(f"Distributed.{k}={v}" for k, v in named.items() if v > 1)
        raise ConfigError(
            f"{keys}: needs a multiple of {others} processes (world = dp_degree x mp_degree x pp_degree x "
            f"sharding_degree) but WORLD_SIZE is {world}; launch with torchrun --nproc_per_node={others} (or "
            "more), or lower the degree")
    if dp * others != world:
        raise ConfigError(
            f"Distributed.dp_degree={dp}: needs {dp * others} processes (dp_degree x mp_degree x pp_degree x "
            f"sharding_degree) but WORLD_SIZE is {world}; leave dp_degree blank (it becomes {world // others}) "
            f"or launch {dp * others} processes")
    if d.ep_degree < 1:
        raise ConfigError(f"Distributed.ep_degree: must be >= 1, got {d.ep_degree}")
    if d.pp_degree > 1 and max(m.num_experts or [1]) > 1:
        raise ConfigError(f"Distributed.pp_degree={d.pp_degree}: pipeline parallel does not train MoE models yet "
                          "(the balancing loss is added outside the schedule); use dp, sharding or ep_degree")
    if d.ep_degree > 1:
        if d.mp_degree > 1 or sh > 1 or d.pp_degree > 1:
            raise ConfigError(f"Distributed.ep_degree={d.ep_degree}: expert parallel composes with data parallel "
                              "only; set Distributed.mp_degree=1, pp_degree=1 and sharding.sharding_degree=1")
        if dp % d.ep_degree:
            raise ConfigError(f"Distributed.ep_degree={d.ep_degree}: must divide dp_degree={dp}")
        bad = sorted({n for n in (m.num_experts or [1]) if n % d.ep_degree})
        if bad or max(m.num_experts or [1]) <= 1:
            raise ConfigError(f"Distributed.ep_degree={d.ep_degree}: must divide every Model.num_experts "
                              f"(got {m.num_experts}) of an MoE model")
    if m.sequence_parallel and d.mp_degree <= 1:
        raise ConfigError("Model.sequence_parallel: needs Distributed.mp_degree > 1 (it splits the activations "
                          "of a tensor-parallel group); set Model.sequence_parallel=False")
    if d.mp_degree > 1:
        heads = m.layer_num_heads or [m.num_attention_heads]
        ffns = m.layer_ffn_sizes or [m.ffn_hidden_size]
        bad_heads = sorted({h for h in heads if h % d.mp_degree})
        if bad_heads:
            raise ConfigError(f"Distributed.mp_degree: {d.mp_degree} does not divide the attention head count "
                              f"{bad_heads[0]} (Model.num_attention_heads / layer_num_heads); each rank holds whole heads")
        bad_ffn = sorted({f for f in ffns if f % d.mp_degree})
        if bad_ffn:
            raise ConfigError(f"Distributed.mp_degree: {d.mp_degree} does not divide the FFN width {bad_ffn[0]} "
                              "(Model.ffn_hidden_size / layer_ffn_sizes)")
        if m.sequence_parallel:
            for split in ("Train", "Eval"):
                seq = getattr(cfg.Data, split).dataset.max_seq_len
                if seq % d.mp_degree:
                    raise ConfigError(f"Data.{split}.dataset.max_seq_len: {seq} is not divisible by "
                                      f"Distributed.mp_degree {d.mp_degree}, which Model.sequence_parallel needs")
    mp = cfg.Engine.mix_precision
    if mp.enable and mp.dtype == "float16" and (d.mp_degree > 1 or sh > 1):
        raise ConfigError(
            "Engine.mix_precision.dtype: float16 with tensor parallel or sharding needs a loss scaler that sees "
            "every rank's gradient shards; use bfloat16 (no loss scaling), or data parallel only")
    if d.backend is not None and d.backend.lower() not in ("nccl", "gloo"):
        raise ConfigError(f"Distributed.backend: {d.backend!r} is not one of nccl, gloo (blank = from the device)")


def check_train_shapes(cfg: Config) -> None:
    """Checks only a training run needs (other verbs never read Data)."""
    check_train_length(cfg)
    m = cfg.Model
    for split in ("Train", "Eval"):
        seq = getattr(cfg.Data, split).dataset.max_seq_len
        if seq > m.max_position_embeddings:
            raise ConfigError(
                f"Data.{split}.dataset.max_seq_len: {seq} exceeds Model.max_position_embeddings "
                f"{m.max_position_embeddings}; lower it or use a model with more positions"
            )


# ----------------------------------------------------------------------------- entry


@dataclasses.dataclass
class CheckpointConfig:
    """What a model directory says about its run, as `model_io.checkpoint_config` read it.

    The loader merges it with the other layers but never reads a checkpoint itself, so config
    sits below model I/O (docs/architecture.md)."""

    source: str                   # the directory as the user gave it, for messages
    raw: dict[str, Any]           # its config in the canonical layout (may carry "__requires__")
    path: Path | None = None      # the resolved directory or file
    is_dir: bool = False
    has_tokenizer: bool = False   # it carries its own tokenizer files


def _portable_checkpoint_raw(raw: dict[str, Any], ck: CheckpointConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """A checkpoint's config without the paths a later run must not follow, and the relative
    paths dropped ({key: value}).

    - `Data.tokenizer` goes when the directory carries tokenizer files: they are the model's
      own, wherever the directory has been copied, and win unless -c/-o names another.
    - Relative paths (written by gptforge before configs stored them absolute) are relative to
      the working directory of a run long gone; reading them against today's would pick the
      wrong files or none.
    - A training step checkpoint (`DIR/step_N`) lives in its run's output directory, so
      `Engine.save_load.output_dir` is DIR, where the directory is now: a resumed run
      continues next to its checkpoint, wherever the run directory was copied.
    """
    p = ck.path if ck.path is not None else Path(ck.source)
    legacy = {}
    for key in PATH_KEYS:
        v = _relative_path_value(raw, key)
        if v is not None:
            legacy[key] = v
            raw = _with(raw, key, None, drop=True)
    if ck.is_dir and re.fullmatch(r"step_\d+", p.name) and _get(raw, "Engine") is not None:
        raw = _with(raw, "Engine.save_load.output_dir", os.path.abspath(p.parent))
        legacy.pop("Engine.save_load.output_dir", None)
    if _at(raw, "Data.tokenizer") is not None and ck.is_dir and ck.has_tokenizer:
        raw = _with(raw, "Data.tokenizer", None, drop=True)
    if "Data.tokenizer" in legacy and ck.is_dir and ck.has_tokenizer:
        del legacy["Data.tokenizer"]
    return raw, legacy


def _report_legacy_paths(raw: dict[str, Any], legacy: dict[str, str], ckpt_dir) -> None:
    """Relative paths dropped from an older checkpoint's config that -c/-o did not set again:
    a missing tokenizer is an error (another one would silently change every id); the rest
    (data, output directories) fall back to this run's values, said once on stderr."""
    unset = {k: v for k, v in legacy.items() if _at(raw, k) is None}
    if "Data.tokenizer" in unset:
        raise ConfigError(
            f"Data.tokenizer: the checkpoint {ckpt_dir} records {unset['Data.tokenizer']!r}, a path relative to the "
            "directory its run was started in, and holds no tokenizer files; pass -o Data.tokenizer=PATH")
    if unset:
        import sys

        shown = ", ".join(f"{k}={v}" for k, v in unset.items())
        print(f"gptforge: {ckpt_dir}: its config.yaml (an older gptforge's) stores paths relative to the directory "
              f"its run was started in; ignoring {shown} (set them with -c/-o if this run needs them)", file=sys.stderr)


def _drop_launch_derived(raw: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config without the values its launch derived from the world size
    (Distributed.dp_degree, Global.local_batch_size): resuming at another world size derives
    them again from the global batch. Engine.save_load.ckpt_dir (the checkpoint that launch
    resumed from) goes too: it would make every later `--ckpt` of this directory a conflict."""
    out = dict(raw)
    for section, key in (("Distributed", "dp_degree"), ("Global", "local_batch_size")):
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section] = {k: v for k, v in out[section].items() if k != key}
    if _at(out, "Engine.save_load.ckpt_dir") is not None:
        out = _with(out, "Engine.save_load.ckpt_dir", None, drop=True)
    return out


def _file_batch_wins(ck_raw: dict[str, Any], file_raw: dict[str, Any]) -> dict[str, Any]:
    """Batch sizes are one statement: when the -c file gives any of global/local/micro, the
    checkpoint's are dropped (an eval recipe's local batch must not meet the training run's
    global batch)."""
    keys = ("global_batch_size", "local_batch_size", "micro_batch_size")
    file_glob = file_raw.get("Global")
    if not (isinstance(file_glob, dict) and any(k in file_glob for k in keys)):
        return ck_raw
    ck_glob = ck_raw.get("Global")
    if not isinstance(ck_glob, dict):
        return ck_raw
    return {**ck_raw, "Global": {k: v for k, v in ck_glob.items() if k not in keys}}


def merge_layers(
    path: str | os.PathLike | None = None,
    overrides: typing.Iterable[str] = (),
    ckpt: CheckpointConfig | None = None,
) -> dict[str, Any]:
    """The merged raw dict: defaults ← checkpoint config ← file ← overrides, presets expanded.

    With a checkpoint the model *shape* always comes from the checkpoint (a -c file written for
    another size would otherwise fail to load); everything else in the file still applies.
    """
    raw: dict[str, Any] = {}
    requires: list[str] = []
    legacy: dict[str, str] = {}
    file_raw = load_raw(path) if path else {}
    keep: tuple[str, ...] = ()
    ckpt_dir = ckpt.source if ckpt is not None else None
    if ckpt is not None:
        raw = copy.deepcopy(ckpt.raw)
        requires = raw.pop("__requires__", [])
        raw = _drop_launch_derived(raw)
        raw, legacy = _portable_checkpoint_raw(raw, ckpt)
        raw = _file_batch_wins(raw, file_raw)
        ck_model = raw.get("Model") or {}
        keep = tuple(k for k in ARCH_KEYS if k in ck_model)
        if isinstance(file_raw.get("Model"), dict):
            file_model = {k: v for k, v in file_raw["Model"].items()
                          if not (k in ck_model and k in ARCH_KEYS) and k != "preset"}
            file_raw = {**file_raw, "Model": file_model}
    raw = deep_merge(raw, file_raw)
    overrides = list(overrides)
    layer = apply_overrides({}, overrides)  # what the -o layer alone sets
    raw = apply_overrides(apply_overrides(raw, overrides), preset_fills(layer, raw, keep))
    if legacy:
        _report_legacy_paths(raw, legacy, ckpt_dir)
    for key in requires:
        if _get(raw, *key.split(".")) is None:
            raise ConfigError(
                f"{key}: the checkpoint {ckpt_dir} does not record it; pass -o {key}=N "
                "(or -c the config the checkpoint was trained with)"
            )
    return apply_preset(raw)


def load_given(
    path: str | os.PathLike | None = None,
    overrides: typing.Iterable[str] = (),
    ckpt: CheckpointConfig | None = None,
) -> Config:
    """The typed config as the layers give it, before `resolve` derives anything."""
    return build_config(merge_layers(path, overrides, ckpt))


def load_config(
    path: str | os.PathLike | None = None,
    overrides: typing.Iterable[str] = (),
    ckpt: CheckpointConfig | None = None,
    world_size: int | None = None,
) -> Config:
    """The resolved config: defaults ← checkpoint config ← file ← overrides → `resolve`.

    `path` is a YAML file or a packaged recipe's name (`gptforge config list`); `ckpt` is what a
    model directory records (`model_io.checkpoint_config`; `model_io.load_run_config` does both).
    """
    return resolve(load_given(path, overrides, ckpt), world_size=world_size)


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML, path keys absolute: a config.yaml written into a model or run
    directory must not depend on the working directory of the run that wrote it."""
    return yaml.safe_dump(absolute_paths(cfg.to_dict()), sort_keys=False, default_flow_style=False)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    Path(path).write_text(config_to_yaml(cfg), encoding="utf-8")
