"""Derive what the reference derives from a typed `Config` (presets, batch sizes, accumulation,
FFN width, padded vocabulary, recompute, MoE and parallel layouts) and check the combinations a
run cannot start with; each error names the key."""

from __future__ import annotations

import os
import typing
from typing import Any

from gptforge.config.presets import GPT2_VOCAB_SIZE, PRESETS
from gptforge.config.sampling import check_kv_cache_dtype, check_sampling
from gptforge.config.schema import Config, DatasetConfig, ModelConfig
from gptforge.config.typed import suggest_key
from gptforge.errors import ConfigError

# --------------------------------------------------------------------------- derive


def _preset_shape(name: Any) -> dict[str, Any]:
    name = str(name)
    if name not in PRESETS:
        raise ConfigError(f"Model.preset: unknown preset {name!r}{suggest_key(name, PRESETS, '')}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]


def raw_get(raw: dict, *path: str) -> Any:
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
        if raw_get(layer, "Data", split, "dataset", "max_seq_len") is not None:
            continue  # this layer's own value: check_train_shapes judges it
        seq = raw_get(below, "Data", split, "dataset", "max_seq_len")
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
    shape = _preset_shape(model["preset"])
    filled = {**shape, **{k: v for k, v in model.items() if v is not None}}
    if model.get("vocab_size") is None and "vocab_size" in shape:
        tokenizer = raw_get(raw, "Data", "tokenizer")
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
            f"{suggest_key(m.recompute_granularity, ('full', 'full_attn', 'core_attn'), '')}"
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
    if max(counts) > 1 and n_moe == 0:  # silently a dense model otherwise
        raise ConfigError(f"Model.expert_interval: {m.expert_interval} places no MoE layer in "
                          f"Model.num_layers={m.num_layers} (every expert_interval-th layer is one) although "
                          f"Model.num_experts={','.join(map(str, counts))}; set expert_interval <= {m.num_layers}, or "
                          "num_experts=1 for a dense model")
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
                          f"{suggest_key(m.moe_gate, MOE_GATES, '')}")
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
    if e.fit_to_max_time and e.max_time is None:
        raise ConfigError("Engine.fit_to_max_time: needs Engine.max_time (the seconds to fit the run into); "
                          "add -o Engine.max_time=SECONDS")
    if e.fit_max_steps is not None and e.fit_max_steps < 1:
        raise ConfigError(f"Engine.fit_max_steps: {e.fit_max_steps} must be a step count >= 1 (or unset)")
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
    check_sampling(cfg.Generation)
    check_kv_cache_dtype(cfg.Generation)
    lr = cfg.Optimizer.lr
    if lr.decay_steps is None or lr.decay_steps <= 0:
        lr.decay_steps = None if e.max_steps < 0 else max(1, e.max_steps)
    if lr.max_lr < 0 or lr.min_lr < 0:
        raise ConfigError("Optimizer.lr.max_lr / min_lr: must be >= 0")
    if not 0.0 <= lr.warmup_rate <= 1.0:
        raise ConfigError(f"Optimizer.lr.warmup_rate: must be in [0, 1], got {lr.warmup_rate}")
    if cfg.Optimizer.grad_clip.clip_norm < 0:
        raise ConfigError(f"Optimizer.grad_clip.clip_norm: must be >= 0, got {cfg.Optimizer.grad_clip.clip_norm}")
    o = cfg.Optimizer
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"Optimizer.muon_momentum: must be in [0, 1), got {o.muon_momentum}")
    if o.name == "Muon" and (d.mp_degree > 1 or d.sharding.sharding_degree > 1):
        # Newton-Schulz needs each weight matrix whole; tensor and sharding parallel split them.
        raise ConfigError("Optimizer.name: Muon needs whole weight matrices, and Distributed.mp_degree / "
                          "sharding.sharding_degree > 1 split them; use FusedAdamW, or data / pipeline parallel")

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
                          f"{suggest_key(oe.lambada_split, ('reference', 'lm_eval'), '')}")
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
