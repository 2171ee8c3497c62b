"""Adapters as PEFT adapter directories over our HF GPT-2 export, both ways.

A directory holds `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(HF_EXPORT), DIR)` loads; keys
are `base_model.model.transformer.h.{i}.{attn.c_attn|attn.c_proj|mlp.c_fc|mlp.c_proj}` and
`base_model.model.lm_head`, each with `.lora_A.weight` [r, in], `.lora_B.weight` [out, r] and
with DoRA `.lora_magnitude_vector` [out]. A and B have the same orientation as ours (peft
keeps them as Linear layers even over GPT-2's transposed Conv1D), so only names and the QKV
row order change.

q/k/v slices. GPT-2's `c_attn` output is q|k|v (all heads each), ours is grouped per head, and
peft has one adapter per `c_attn`. Separate q/k/v adapters are one adapter there, exactly: A =
the slices' A stacked (rank R = Σ r), B = block-diagonal over the q|k|v row blocks, each block
B_x·s_x/s (s = the first slice's scaling, written as `alpha_pattern`/`rank_pattern` entries for
that c_attn). With DoRA the magnitude of a row outside the chosen slices is that row's norm,
which makes its factor m/n exactly 1. Rows are independent in both LoRA and DoRA, so this is
the same function; only dropout differs (one mask over c_attn's input instead of one per
slice). `gptforge_adapter.json` records the slices, so reading the directory back restores
them; a directory without it (made by peft) gives one adapter over the whole fused projection.

Refused: adapters of a pruned model (the HF export pads heads/FFN to a uniform shape),
peft options with no meaning here (`bias` other than none, `lora_bias`, `modules_to_save`,
other tensors), and an adapter whose shapes do not fit the model.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from gptforge.adapters.inject import attach, attach_head, has_adapters, lora_layers
from gptforge.adapters.layers import (
    FULL,
    QKV_SLICES,
    LoraHead,
    LoraLinear,
    LoraPair,
    effective_weight,
    lora_scaling,
)
from gptforge.errors import CheckpointError, UsageError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
META_FILE = "gptforge_adapter.json"
PREFIX = "base_model.model."
HF_NAMES = {"attn.qkv_proj": "attn.c_attn", "attn.out_proj": "attn.c_proj", "linear1": "mlp.c_fc",
            "linear2": "mlp.c_proj"}
_OURS = {v: k for k, v in HF_NAMES.items()}
_HF_MODULE = re.compile(r"^(?:transformer\.)?h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)$")
_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector")


def is_adapter_dir(path: str | os.PathLike) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


# ------------------------------------------------------------------------------- our → peft


def _qkv_to_hf(t: torch.Tensor, hd: int) -> torch.Tensor:
    """Per-head grouped rows → q|k|v rows (GPT-2's c_attn order)."""
    return t.reshape(-1, 3, hd, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def _qkv_from_hf(t: torch.Tensor, hd: int) -> torch.Tensor:
    return t.reshape(3, -1, hd, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def _check_uniform(model: nn.Module) -> None:
    hidden = model.wte.weight.shape[1]
    for i, blk in enumerate(model.blocks):
        if getattr(blk, "moe", None) is not None:
            raise UsageError(f"blocks.{i} is a Mixture-of-Experts layer: an MoE model has no HF GPT-2 export, so its "
                             "adapters have no PEFT form; merge them instead (gptforge merge)")
        qkv = blk.attn.qkv_proj
        if qkv.out_features != 3 * hidden or blk.linear1.out_features != model.blocks[0].linear1.out_features:
            raise UsageError(f"blocks.{i} has a pruned shape: an adapter of a pruned model has no PEFT form over the "
                             "zero-padded HF export; merge it instead (gptforge merge)")


@torch.no_grad()
def _qkv_module(mod: LoraLinear) -> tuple[dict, dict]:
    """({A, B, m}, {r, alpha, slices}) of the fused QKV's adapters as one c_attn adapter."""
    hd, pairs = mod.head_dim, dict(mod.adapters.items())
    if FULL in pairs:
        p = pairs[FULL]
        t = {"A": p.lora_A, "B": _qkv_to_hf(p.lora_B, hd)}
        if p.dora:
            t["m"] = _qkv_to_hf(p.magnitude, hd)
        return t, {"r": p.r, "alpha": p.alpha, "rslora": p.rslora, "dora": p.dora}
    first = next(iter(pairs.values()))
    dora = {p.dora for p in pairs.values()}
    if len(dora) > 1:
        raise UsageError("q/k/v adapters of one layer mix LoRA and DoRA: peft's c_attn has one kind")
    R, H = sum(p.r for p in pairs.values()), mod.out_features // 3
    A = torch.cat([p.lora_A for p in pairs.values()])
    B = A.new_zeros(3 * H, R)
    w = effective_weight(mod.base).detach().float() if first.dora else None
    m = _qkv_to_hf(torch.linalg.norm(w, dim=1), hd) if first.dora else None
    col = 0
    for name, p in pairs.items():
        j = QKV_SLICES.index(name)
        B[j * H:(j + 1) * H, col:col + p.r] = p.lora_B * (p.scaling / first.scaling)
        if p.dora:
            m[j * H:(j + 1) * H] = p.magnitude
        col += p.r
    alpha = first.scaling * (math.sqrt(R) if first.rslora else R)
    t = {"A": A, "B": B} | ({"m": m} if m is not None else {})
    slices = {n: {"r": p.r, "alpha": p.alpha} for n, p in pairs.items()}
    return t, {"r": R, "alpha": alpha, "rslora": first.rslora, "dora": first.dora, "slices": slices}


def peft_parts(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(adapter_model tensors, adapter_config dict, gptforge_adapter dict) of `model`'s adapters."""
    if not has_adapters(model):
        raise UsageError("the model has no adapters to save")
    if any(m.merged for m in lora_layers(model).values()):
        raise UsageError("the adapters are merged into the weights; save the model, not an adapter")
    _check_uniform(model)
    modules: dict[str, tuple[dict, dict]] = {}
    for name, mod in lora_layers(model).items():
        i, path = re.fullmatch(r"blocks\.(\d+)\.(.+)", name).groups()
        hf = f"transformer.h.{i}.{HF_NAMES[path]}"
        if path == "attn.qkv_proj":
            modules[hf] = _qkv_module(mod)
        else:
            p = mod.adapters[FULL]
            modules[hf] = ({"A": p.lora_A, "B": p.lora_B} | ({"m": p.magnitude} if p.dora else {}),
                           {"r": p.r, "alpha": p.alpha, "rslora": p.rslora, "dora": p.dora})
    if isinstance(model.wte, LoraHead):
        p = model.wte.pair
        modules["lm_head"] = ({"A": p.lora_A, "B": p.lora_B} | ({"m": p.magnitude} if p.dora else {}),
                              {"r": p.r, "alpha": p.alpha, "rslora": p.rslora, "dora": p.dora})
    return _assemble(modules, model)


def _assemble(modules: dict[str, tuple[dict, dict]], model: nn.Module) -> tuple[dict, dict, dict]:
    kinds = {(c["rslora"], c["dora"]) for _, c in modules.values()}
    if len(kinds) > 1:
        raise UsageError("the adapters mix rsLoRA/DoRA settings; a PEFT adapter has one setting for all modules")
    rslora, dora = kinds.pop()
    r, alpha = Counter((c["r"], c["alpha"]) for _, c in modules.values()).most_common(1)[0][0]
    tensors: dict[str, torch.Tensor] = {}
    rank_pattern, alpha_pattern, slices = {}, {}, {}
    for hf, (t, c) in modules.items():
        tensors[f"{PREFIX}{hf}.lora_A.weight"] = t["A"]
        tensors[f"{PREFIX}{hf}.lora_B.weight"] = t["B"]
        if "m" in t:
            tensors[f"{PREFIX}{hf}.lora_magnitude_vector"] = t["m"]
        if c["r"] != r:
            rank_pattern[hf] = c["r"]
        if c["alpha"] != alpha:
            alpha_pattern[hf] = c["alpha"]
        if "slices" in c:
            slices[hf] = c["slices"]
    layer_kinds: dict[str, set[str]] = {}
    for hf in modules:
        if hf != "lm_head":
            layer_kinds.setdefault(hf.split(".")[2], set()).add(hf.split(".", 3)[3])
    uniform = len(layer_kinds) == len(model.blocks) and len({frozenset(k) for k in layer_kinds.values()}) == 1
    # Suffixes (attn.c_attn, mlp.c_fc, ...) when every block has the same adapters, else full names.
    targets = sorted({hf.split(".", 3)[-1] for hf in modules}) if uniform else sorted(modules)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": r, "lora_alpha": alpha, "lora_dropout": _dropout(model), "use_rslora": rslora, "use_dora": dora,
        "target_modules": targets, "fan_in_fan_out": True, "bias": "none", "lora_bias": False,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
    }
    meta = {"format": 1, "qkv_slices": slices}
    return {k: v.detach().to("cpu").float().contiguous().clone() for k, v in tensors.items()}, config, meta


def _dropout(model: nn.Module) -> float:
    ps = [m.dropout_p for m in model.modules() if isinstance(m, LoraPair)]
    return max(ps) if ps else 0.0


def save_adapter(model: nn.Module, out_dir: str | os.PathLike, base_model: str | None = None,
                 overwrite: bool = False) -> Path:
    """Write `model`'s adapters as a PEFT adapter directory (atomically: a temp dir renamed into
    place); `base_model` is recorded as base_model_name_or_path (e.g. the HF export's path)."""
    from safetensors.torch import save_file

    from gptforge.durable import publish_dir

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise UsageError(f"{out}: already exists; choose another directory or pass --force")
    tensors, config, meta = peft_parts(model)
    config["base_model_name_or_path"] = base_model
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o755)
        publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ------------------------------------------------------------------------------- peft → ours


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    from safetensors.torch import load_file

    if not path.is_dir():
        raise CheckpointError(f"{path}: adapter directory not found" if not path.exists() else
                              f"{path}: is a file, expected a PEFT adapter directory")
    cfg_file, w_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (cfg_file, w_file):
        if not f.is_file():
            hint = " (adapter_model.bin is not read: re-save it with safetensors)" if f == w_file else ""
            raise CheckpointError(f"{f}: missing; a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}{hint}")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{cfg_file}: unreadable JSON ({e})") from None
    try:
        tensors = load_file(str(w_file))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types
        raise CheckpointError(f"{w_file}: unreadable ({e})") from None
    meta = {}
    if (path / META_FILE).is_file():
        try:
            meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path / META_FILE}: unreadable JSON ({e})") from None
    return config, tensors, meta


def _check_config(c: dict, f: Path) -> None:
    def bad(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{f}: {key}={c.get(key)!r}: {why}")

    if c.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", "only LoRA/DoRA adapters load here")
    if c.get("bias", "none") != "none":
        raise bad("bias", "trained biases are not supported; use bias=none")
    if c.get("lora_bias"):
        raise bad("lora_bias", "not supported")
    if c.get("modules_to_save"):
        raise bad("modules_to_save", "fully trained extra modules are not supported; only LoRA/DoRA tensors load")
    if c.get("layer_replication") or c.get("trainable_token_indices"):
        raise bad("layer_replication" if c.get("layer_replication") else "trainable_token_indices", "not supported")


def _pattern(patterns: dict, name: str):
    """peft's `get_pattern_key`: the first key matching the end of the module name."""
    for key in patterns or {}:
        if re.match(rf"(.*\.)?({key})$", name):
            return patterns[key]
    return None


def _group(tensors: dict[str, torch.Tensor], f: Path) -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if name.endswith(".base_layer.weight") and name.startswith("lm_head"):
            continue  # peft also saves the tied lm_head weight itself: the base's, not the adapter's
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise CheckpointError(f"{f}: tensor {key!r} is not a LoRA/DoRA tensor of GPT-2 (lora_A, lora_B, "
                                  "lora_magnitude_vector); it cannot be loaded")
        mod = name[: -len(suffix)]
        if mod != "lm_head" and not _HF_MODULE.match(mod):
            raise CheckpointError(f"{f}: tensor {key!r} targets {mod!r}, which is not a GPT-2 Linear "
                                  "(h.N.attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, lm_head)")
        modules.setdefault(mod, {})["ABm"[_SUFFIXES.index(suffix)]] = t.float()
    return modules


def _pair(t: dict, alpha: float, rslora: bool, dropout: float, key: str, f: Path, out_f: int, in_f: int) -> LoraPair:
    if "A" not in t or "B" not in t:
        raise CheckpointError(f"{f}: {key} lacks lora_A or lora_B")
    A, B = t["A"], t["B"]
    r = A.shape[0]
    if A.dim() != 2 or B.dim() != 2 or tuple(A.shape) != (r, in_f) or tuple(B.shape) != (out_f, r):
        raise CheckpointError(f"{f}: {key}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)} do not fit a layer "
                              f"of {in_f} inputs and {out_f} outputs (is this the adapter of another model?)")
    pair = LoraPair(in_f, out_f, r, alpha, rslora, dropout, "m" in t, device=A.device)
    with torch.no_grad():
        pair.lora_A.copy_(A)
        pair.lora_B.copy_(B)
        if "m" in t:
            if tuple(t["m"].shape) != (out_f,):
                raise CheckpointError(f"{f}: {key}.lora_magnitude_vector has shape {tuple(t['m'].shape)}, expected ({out_f},)")
            pair.magnitude.copy_(t["m"])
    return pair


def _split_slices(t: dict, slices: dict, hd: int, rslora: bool, dropout: float, key: str, f: Path,
                  H: int, in_f: int, scaling: float) -> dict[str, LoraPair]:
    """c_attn's block-structured adapter back into the q/k/v pairs it was written from."""
    out, col = {}, 0
    for name, spec in slices.items():
        r, alpha = int(spec["r"]), float(spec["alpha"])
        j = QKV_SLICES.index(name)
        part = {"A": t["A"][col:col + r],
                "B": t["B"][j * H:(j + 1) * H, col:col + r] * (scaling / (alpha / (math.sqrt(r) if rslora else r)))}
        if "m" in t:
            part["m"] = t["m"][j * H:(j + 1) * H]
        out[name] = _pair(part, alpha, rslora, dropout, f"{key} ({name})", f, H, in_f)
        col += r
    if col != t["A"].shape[0]:
        raise CheckpointError(f"{f}: {key}: rank {t['A'].shape[0]} differs from the recorded slices' {col}")
    return out


HEAD = "head"  # the target of a head (lm_head) pair in `read_pairs`


def read_pairs(model: nn.Module, adapter_dir: str | os.PathLike) -> tuple[list[tuple[str, str, LoraPair]], list[str]]:
    """The adapters of a PEFT adapter directory (ours or peft's) built for `model`, not attached:
    ([(our module path or HEAD, `full` or a q/k/v slice, pair)], the adapted HF module names).
    Every shape is checked against the model (CheckpointError naming the file and tensor)."""
    path = Path(adapter_dir)
    config, tensors, meta = _read(path)
    f = path / CONFIG_FILE
    _check_config(config, f)
    _check_uniform(model)
    rslora, dropout = bool(config.get("use_rslora")), float(config.get("lora_dropout") or 0.0)
    modules = _group(tensors, path / WEIGHTS_FILE)
    if not modules:
        raise CheckpointError(f"{path / WEIGHTS_FILE}: holds no LoRA tensors")
    dora = bool(config.get("use_dora"))
    out: list[tuple[str, str, LoraPair]] = []
    for hf, t in sorted(modules.items()):
        if "A" not in t or "B" not in t:
            raise CheckpointError(f"{path / WEIGHTS_FILE}: {hf} lacks lora_A or lora_B")
        if ("m" in t) != dora:
            raise CheckpointError(f"{path / WEIGHTS_FILE}: {hf} {'lacks' if dora else 'has'} lora_magnitude_vector "
                                  f"but {CONFIG_FILE} says use_dora={dora}")
        alpha = _pattern(config.get("alpha_pattern"), hf)
        alpha = float(config.get("lora_alpha", 8) if alpha is None else alpha)
        if hf == "lm_head":
            w = model.wte.weight
            out.append((HEAD, FULL, _pair(t, alpha, rslora, dropout, hf, path, w.shape[0], w.shape[1])))
            continue
        i, kind = _HF_MODULE.match(hf).groups()
        if int(i) >= len(model.blocks):
            raise CheckpointError(f"{path}: {hf} is beyond the model's {len(model.blocks)} blocks")
        ours = f"blocks.{i}.{_OURS[kind]}"
        mod = model.get_submodule(ours)
        out_f, in_f = mod.out_features, mod.in_features
        if kind != "attn.c_attn":
            out.append((ours, FULL, _pair(t, alpha, rslora, dropout, hf, path, out_f, in_f)))
            continue
        hd = model.blocks[int(i)].attn.head_dim
        slices = (meta.get("qkv_slices") or {}).get(hf)
        if slices:
            scaling = lora_scaling(alpha, t["A"].shape[0], rslora)
            for name, pair in _split_slices(t, slices, hd, rslora, dropout, hf, path, out_f // 3, in_f, scaling).items():
                out.append((ours, name, pair))
            continue
        fused = {"A": t["A"], "B": _qkv_from_hf(t["B"], hd)} if "B" in t else dict(t)
        if "m" in t:
            fused["m"] = _qkv_from_hf(t["m"], hd)
        out.append((ours, FULL, _pair(fused, alpha, rslora, dropout, hf, path, out_f, in_f)))
    return out, sorted(modules)


def load_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> list[str]:
    """Add the adapters of a PEFT adapter directory (ours or peft's) to `model` in place; the
    base is frozen as for training. Returns the adapted module names (HF names)."""
    if has_adapters(model):
        raise UsageError(f"{adapter_dir}: the model already has adapters; load one adapter directory at a time")
    pairs, names = read_pairs(model, adapter_dir)
    for p in model.parameters():
        p.requires_grad_(False)
    for target, name, pair in pairs:
        if target == HEAD:
            attach_head(model, pair)
        else:
            attach(model, target, name, pair)
    return names


def apply_adapter(model: nn.Module, adapter_dir: str | os.PathLike) -> nn.Module:
    """The loaders' hook: `model` with the PEFT adapter directory's adapters added (eval mode
    kept as it was). One call, so any model loader can offer `--adapter DIR`."""
    load_adapter(model, adapter_dir)
    return model


def adapter_digest(adapter_dir: str | os.PathLike) -> str:
    """sha256 of the adapter's config and weights: the identity a merge records."""
    import hashlib

    path = Path(adapter_dir)
    if not is_adapter_dir(path) or not (path / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{path}: not a PEFT adapter directory ({CONFIG_FILE} + {WEIGHTS_FILE})")
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(path / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
