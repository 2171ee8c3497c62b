"""Load, merge, override, validate and derive a `Config` (the typed build is `typed.py`, the
derivation and cross-key checks `resolve.py`).

Pipeline: YAML file (with `_base_` inheritance, each document normalised by `aliases`) →
optional checkpoint config underneath → `-o Section.key=value` overrides → typed dataclasses
(unknown keys and wrong types raise `ConfigError` naming the key path and the closest valid
key) → `resolve` derives what the reference derives (batch sizes, accumulation, ffn width,
padded vocab, recompute defaults).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from gptforge.config.aliases import normalize_path, normalize_raw
from gptforge.config.recipes import locate, packaged_fallback
from gptforge.config.resolve import apply_preset, preset_fills, raw_get, resolve
from gptforge.config.schema import Config
from gptforge.config.typed import build_config
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
    return raw_get(raw, *key.split("."))


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
    foreign_device: str | None = None  # a recorded CUDA Global.device, dropped: this machine has none


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
    if ck.is_dir and re.fullmatch(r"step_\d+", p.name) and raw_get(raw, "Engine") is not None:
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
    resumed from) goes too: it would make every later `--ckpt` of this directory a conflict.
    So do the time limits of that run (Engine.max_time, fit_to_max_time, fit_max_steps): they
    were its own, and a fine-tune started from it would otherwise stretch to fill them."""
    out = dict(raw)
    for section, key in (("Distributed", "dp_degree"), ("Global", "local_batch_size"), ("Engine", "max_time"),
                         ("Engine", "fit_to_max_time"), ("Engine", "fit_max_steps")):
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section] = {k: v for k, v in out[section].items() if k != key}
    if _at(out, "Engine.save_load.ckpt_dir") is not None:
        out = _with(out, "Engine.save_load.ckpt_dir", None, drop=True)
    # An older gptforge stored the default eval window (1024) in every checkpoint; one longer than
    # the model's context was never a choice for this model: the default (its context) applies.
    window, ctx = _at(out, "Offline_Eval.max_seq_len"), _at(out, "Model.max_position_embeddings")
    if isinstance(window, int) and isinstance(ctx, int) and window > ctx:
        out = _with(out, "Offline_Eval.max_seq_len", None, drop=True)
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
    if ckpt is not None and ckpt.foreign_device and _at(raw, "Global.device") is None:
        import sys

        print(f"gptforge: {ckpt_dir} was trained with Global.device={ckpt.foreign_device}; this machine has no "
              "CUDA device, so it runs on the CPU (-o Global.device=... to choose)", file=sys.stderr)
    for key in requires:
        if raw_get(raw, *key.split(".")) is None:
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
