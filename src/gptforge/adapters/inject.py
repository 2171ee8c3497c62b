"""Putting LoRA/DoRA adapters into a GPT, and what a trainer or an exporter needs from them.

`apply_lora(model, cfg)` wraps the chosen projections of the chosen blocks (see `TARGETS`),
freezes everything else and returns the wrapped names. Targets:

- `q`, `k`, `v`: separate adapters on those slices of the fused `attn.qkv_proj` (each its
  own A [r, hidden] and B [heads·head_dim, r]);
- `qkv`: one adapter over the whole fused projection (what peft's `c_attn` target is);
- `out_proj`, `linear1`, `linear2`: the other block Linears; `all` = qkv + these three;
- `head`: the vocabulary projection (tied to `wte`; see layers.LoraHead).

Mixture-of-Experts FFNs (`blocks.i.moe`) are refused for `linear1`/`linear2`: the stacked
expert tensors are not Linears, and an adapter per expert has no peft form over GPT-2.

Parameter names: a wrapped Linear keeps its weights under `<name>.base.` and its adapters
under `<name>.adapters.{full|q|k|v}.{lora_A,lora_B,magnitude}`; the head under
`wte.base.weight` and `wte.pair.*`. `adapter_state_dict` / `load_adapter_state_dict` carry
only the adapters (exact resume stores them with the optimizer state of `trainable_parameters`).
"""

from __future__ import annotations

import torch
from torch import nn

from gptforge.adapters.layers import (
    FULL,
    INITS,
    QKV_SLICES,
    LoraHead,
    LoraLinear,
    LoraPair,
    effective_weight,
    slice_rows,
)
from gptforge.config.schema import LoraConfig
from gptforge.errors import ConfigError, UsageError
from gptforge.transforms.int8 import Int8Embedding, Int8Linear
from gptforge.transforms.quant import QuantLinear, install_head

BLOCK_TARGETS = {"qkv": "attn.qkv_proj", "out_proj": "attn.out_proj", "linear1": "linear1", "linear2": "linear2"}
TARGETS = (*QKV_SLICES, *BLOCK_TARGETS, "head", "all")
WRAPPABLE = (nn.Linear, QuantLinear, Int8Linear)


def validate(cfg: LoraConfig, num_layers: int, key: str = "lora") -> tuple[set[str], list[int]]:
    """(target names with `all` expanded, block indices); ConfigError naming the key otherwise."""
    if not isinstance(cfg.r, int) or cfg.r < 1:
        raise ConfigError(f"{key}.r: must be a positive integer, got {cfg.r!r}")
    if cfg.alpha <= 0:
        raise ConfigError(f"{key}.alpha: must be > 0, got {cfg.alpha}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"{key}.dropout: must be in [0, 1), got {cfg.dropout}")
    if cfg.init not in INITS:
        raise ConfigError(f"{key}.init: {cfg.init!r} is not one of {', '.join(INITS)}")
    targets = list(cfg.targets or ())
    if not targets:
        raise ConfigError(f"{key}.targets: empty; choose from {', '.join(TARGETS)}")
    bad = [t for t in targets if t not in TARGETS]
    if bad:
        raise ConfigError(f"{key}.targets: {bad} not among {', '.join(TARGETS)}")
    chosen = set(targets)
    if "all" in chosen:
        chosen = (chosen - {"all"}) | set(BLOCK_TARGETS)
    if "qkv" in chosen and chosen & set(QKV_SLICES):
        raise ConfigError(f"{key}.targets: 'qkv' (one adapter over the fused projection) and the slices "
                          f"{sorted(chosen & set(QKV_SLICES))} overlap; choose one form")
    layers = list(range(num_layers)) if cfg.layers is None else list(cfg.layers)
    odd = [i for i in layers if not isinstance(i, int) or not 0 <= i < num_layers]
    if odd or not layers:
        raise ConfigError(f"{key}.layers: {odd or layers} match no block; the model has blocks 0..{num_layers - 1}")
    return chosen, sorted(set(layers))


def _wrapper(model: nn.Module, name: str, key: str) -> LoraLinear:
    mod = model.get_submodule(name)
    if isinstance(mod, LoraLinear):
        return mod
    if not isinstance(mod, WRAPPABLE) or (isinstance(mod, nn.Linear) and type(mod) not in (nn.Linear, QuantLinear)):
        raise ConfigError(f"{key}.targets: {name} is a {type(mod).__name__}; adapters go on plain, fake-quant "
                          "(QAT/PTQ) or INT8 Linears")
    head_dim = model.get_submodule(name.rpartition(".")[0]).head_dim if name.endswith("qkv_proj") else None
    wrapped = LoraLinear(mod, head_dim).train(mod.training)
    model.set_submodule(name, wrapped)
    return wrapped


def attach(model: nn.Module, path: str, name: str, pair: LoraPair, key: str = "lora") -> None:
    """Put `pair` on block Linear `path` (`full`, or slice q/k/v of a fused QKV)."""
    wrapped = _wrapper(model, path, key)
    pair.to(wrapped.base.weight.device).train(wrapped.training)
    if name in wrapped.adapters or (wrapped.adapters and (name == FULL or FULL in wrapped.adapters)):
        raise ConfigError(f"{key}: {path} already has an adapter over the rows of {name!r}")
    wrapped.add(name, pair)


def attach_head(model: nn.Module, pair: LoraPair) -> None:
    """Put `pair` on the vocabulary projection (see layers.LoraHead)."""
    model.wte = LoraHead(model.wte, pair.to(model.wte.weight.device)).train(model.training)
    install_head(model)


def _new_pair(cfg: LoraConfig, weight: torch.Tensor) -> LoraPair:
    pair = LoraPair(weight.shape[1], weight.shape[0], cfg.r, cfg.alpha, cfg.rslora, cfg.dropout, cfg.dora,
                    device=weight.device)
    pair.reset(cfg.init, weight)
    return pair


def _block_targets(chosen: set[str]) -> list[tuple[str, str]]:
    """(projection, adapter name) pairs of one block, in a fixed order."""
    out = [("qkv", s) for s in QKV_SLICES if s in chosen]
    return out + [(k, FULL) for k in BLOCK_TARGETS if k in chosen]


def apply_lora(model: nn.Module, cfg: LoraConfig, key: str = "lora") -> list[str]:
    """Wrap the targets of `cfg` in `model` (in place), freeze the rest; returns the adapted
    names (`blocks.0.attn.qkv_proj.q`, …, `head`). Errors name `key.<field>`."""
    chosen, layers = validate(cfg, len(model.blocks), key)
    if has_adapters(model):
        raise UsageError("the model already has adapters; merge or remove them before adding another set")
    for p in model.parameters():
        p.requires_grad_(False)
    done: list[str] = []
    for i in layers:
        for kind, name in _block_targets(chosen):
            if kind in ("linear1", "linear2") and getattr(model.blocks[i], "moe", None) is not None:
                raise ConfigError(f"{key}.targets: blocks.{i} is a Mixture-of-Experts layer; adapters on expert "
                                  f"tensors are not supported: leave out linear1/linear2 or set {key}.layers")
            path = f"blocks.{i}.{BLOCK_TARGETS[kind]}"
            base = model.get_submodule(path)
            base = base.base if isinstance(base, LoraLinear) else base
            w = effective_weight(base).detach().float()
            if name != FULL:
                w = slice_rows(w, model.blocks[i].attn.head_dim, name)
            attach(model, path, name, _new_pair(cfg, w), key)
            done.append(path if name == FULL else f"{path}.{name}")
    if "head" in chosen:
        attach_head(model, _new_pair(cfg, effective_weight(model.wte).detach().float()))
        done.append("head")
    return done


# ------------------------------------------------------------------------- inspection


def lora_layers(model: nn.Module) -> dict[str, LoraLinear]:
    """{name: LoraLinear} of a model with adapters."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, (LoraLinear, LoraHead)) for m in model.modules())


def _is_adapter_param(name: str) -> bool:
    return ".adapters." in name or name.startswith("wte.pair.")


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapter parameters in a fixed order (the optimizer's order, so its state resumes)."""
    return [(n, p) for n, p in model.named_parameters() if _is_adapter_param(n)]


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable adapter parameters, all weights of the model with its adapters; an INT8
    layer's int8 weight counts, though it is a buffer)."""
    int8 = sum(m.weight.numel() for m in model.modules() if isinstance(m, Int8Linear | Int8Embedding))
    return (sum(p.numel() for _, p in trainable_parameters(model)),
            sum(p.numel() for p in model.parameters()) + int8)


def describe(model: nn.Module) -> str:
    """One line for the log: trainable count, share and what is adapted."""
    n, total = count_parameters(model)
    where = len(lora_layers(model)) + isinstance(model.wte, LoraHead)
    return f"trainable parameters: {n:,} of {total:,} ({100 * n / max(total, 1):.3f}%), adapters on {where} module(s)"


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters' tensors (detached, CPU), under the wrapped model's names."""
    return {n: p.detach().to("cpu").contiguous().clone() for n, p in trainable_parameters(model)}


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors under the plain model's names (`.base.` dropped, adapters left
    out, unmerged): what `model_io.load_model` reads back without the adapters."""
    wrapped = [n for n, m in model.named_modules() if isinstance(m, (LoraLinear, LoraHead))]
    out = {}
    for k, v in model.state_dict().items():
        if _is_adapter_param(k) or k.endswith(".lora_merged"):
            continue
        for w in wrapped:
            if k.startswith(w + ".base."):
                k = w + "." + k[len(w) + len(".base."):]
                break
        out[k] = v.detach().to("cpu").contiguous().clone()
    return out


@torch.no_grad()
def load_adapter_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], source: str = "adapter state") -> None:
    """Copy adapter tensors into a model with the same adapters (in place; identities kept)."""
    from gptforge.errors import CheckpointError

    own = dict(trainable_parameters(model))
    missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{source}: adapters do not match the model's (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}); use the same targets, layers, rank and dora setting")
    for n, p in own.items():
        if tuple(p.shape) != tuple(sd[n].shape):
            raise CheckpointError(f"{source}: {n} has shape {tuple(sd[n].shape)}, the model's is {tuple(p.shape)}")
        p.copy_(sd[n])


# ----------------------------------------------------------------------------- merging


@torch.no_grad()
def _write_base(base: nn.Module, w: torch.Tensor) -> None:
    if isinstance(base, Int8Linear):
        base.quantize_weight_(w)  # int8 cannot hold a float delta: re-quantize W_dq + ΔW (docs/lora.md)
    else:
        base.weight.copy_(w.to(base.weight.dtype))


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Fold every unmerged adapter into its base weight (in place) and mark it merged; returns
    how many layers were merged now (0 when all were already: merging twice = merging once).
    A fake-quant base keeps quantizing the merged float weight; an INT8 base is re-quantized
    from its dequantized weight + the delta. The head adapter is refused (the head is tied)."""
    if isinstance(model.wte, LoraHead):
        raise UsageError("a head adapter cannot be merged: the head is tied to the word embedding wte, and "
                         "merging would change the input embedding too; keep it as an adapter (--adapter DIR)")
    n = 0
    for mod in lora_layers(model).values():
        if mod.merged:
            continue
        if isinstance(mod.base, QuantLinear):  # merge into the float master weight the fake-quant rounds
            w = mod.merged_weight(mod.base.weight)
        else:
            w = mod.merged_weight()
        _write_base(mod.base, w)
        mod.merged = True
        n += 1
    return n


def unload(model: nn.Module, merge: bool = True) -> nn.Module:
    """Put the base modules back in place of the wrappers (after merging them unless
    `merge=False`, which drops the adapters); returns the model."""
    if merge:
        merge_adapters(model)
    for name, mod in lora_layers(model).items():
        model.set_submodule(name, mod.base)
    if isinstance(model.wte, LoraHead):
        model.wte = model.wte.base
        if not hasattr(model.wte, "project"):
            model.__dict__.pop("logits", None)  # the class's float head again
    return model
