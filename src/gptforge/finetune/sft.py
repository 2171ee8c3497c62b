"""`gptforge sft`: supervised instruction tuning of a pretrained GPT (docs/sft.md).

The run is pretraining's `Trainer` (train/trainer.py: optimizer, schedule, precision,
accumulation, checkpoints, exact resume, the run lock, logging) over other data: rows of
tokenized conversations (data/instructions.py → data/chat_template.py → data/packing.py). The
step's loss (`rows_loss`) is the model's token loss over the learned tokens (assistant turns or
completions, and EOS), with packed rows' block-diagonal attention, computed without the
batch's padding and, for LoRA, with the head's logits for the learned tokens only.

The chat template goes with the tokenizer into every checkpoint's tokenizer_config.json, so
the tuned model is used with the template it was trained on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gptforge.config.schema import Config, DatasetConfig
from gptforge.data.chat_template import ChatTemplate, template_for
from gptforge.data.instructions import Record, read_records, split_records
from gptforge.data.packing import Rows, build_rows, compact_batch, encode_plain, packed_attention_mask
from gptforge.errors import CheckpointError, ConfigError, DataError
from gptforge.finetune.head_loss import frozen_head, frozen_head_loss
from gptforge.train.trainer import Trainer, TrainResult

METHODS = ("full", "lora")


@dataclass
class Base:
    """The model to tune with its config (shape from the checkpoint), tokenizer and template."""

    model: nn.Module
    cfg: Config
    tokenizer: object
    template: ChatTemplate
    path: Path


def check_instruct(cfg: Config) -> None:
    """The Instruct keys that every sft / dpo run needs to make sense."""
    ins = cfg.Instruct
    if ins.method not in METHODS:
        raise ConfigError(f"Instruct.method: {ins.method!r} is not one of {', '.join(METHODS)}")
    if ins.epochs < 1:
        raise ConfigError(f"Instruct.epochs: {ins.epochs} must be >= 1")
    if ins.max_steps is not None and ins.max_steps < 1:
        raise ConfigError(f"Instruct.max_steps: {ins.max_steps} must be >= 1 (or blank: epochs decide)")
    if not ins.beta > 0:
        raise ConfigError(f"Instruct.beta: {ins.beta} must be > 0")
    if not 0.0 <= ins.label_smoothing < 0.5:
        raise ConfigError(f"Instruct.label_smoothing: {ins.label_smoothing} must be in [0, 0.5)")


def load_base(cfg: Config, pretrained: str | os.PathLike | None, device=None) -> Base:
    """Load the model to tune (shape from its checkpoint) and its tokenizer + chat template."""
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import load_model, read_checkpoint_config, resolve_checkpoint_path

    spec = pretrained or cfg.Model.pretrained or cfg.Compress.pretrained
    if not spec:
        raise ConfigError("Model.pretrained: give the model to tune with --ckpt DIR (or -o Model.pretrained=DIR)")
    p = resolve_checkpoint_path(spec)
    converted = ((read_checkpoint_config(p).get("Compress") or {}).get("Quantization") or {}).get("converted")
    if converted and cfg.Instruct.method != "lora":  # LoRA trains float adapters over the frozen INT8 layers
        raise CheckpointError(f"{p}: a converted INT8 model cannot be fully fine-tuned; tune the float or QAT model, "
                              "or train LoRA adapters over it (--method lora)")
    if device is None:
        from gptforge.device import select_device

        device = select_device(cfg.Global.device)
    model, cfg = load_model(p, cfg, device=device)
    inherit_text_dirs(cfg, read_checkpoint_config(p))
    tok = load_tokenizer(cfg.Data.tokenizer, p if p.is_dir() else None)
    if tok.vocab_size > model.wte.weight.shape[0]:
        raise ConfigError(f"Data.tokenizer: {tok.name!r} has {tok.vocab_size} tokens but the model's vocabulary is "
                          f"{model.wte.weight.shape[0]}; use the tokenizer the model was trained with")
    template = template_for(tok, cfg.Instruct.chat_template)
    cfg.Model.pretrained = str(p.resolve())
    return Base(model, cfg, tok.with_chat_template(template.source), template, p)


def inherit_text_dirs(cfg: Config, base_raw: dict) -> None:
    """Keep the base's pretraining text dirs where this run left `Data.<split>.dataset.input_dir` at its
    default: tuning reads Instruct data, but the tuned model's config is what `ptq` calibrates on and
    `eval` reads, and the default would name an unrelated `./data` (often the instruction data)."""
    default = os.path.abspath(os.path.expanduser(DatasetConfig().input_dir))
    for split in ("Train", "Eval", "Test"):
        ds = getattr(cfg.Data, split).dataset
        own = ds.input_dir
        base = (((base_raw.get("Data") or {}).get(split) or {}).get("dataset") or {}).get("input_dir")
        if base and own.lower() != "builtin" and os.path.abspath(os.path.expanduser(own)) == default:
            ds.input_dir = str(base)


def records(cfg: Config, preference: bool) -> tuple[list[Record], list[Record]]:
    """(train, validation) records: Instruct.eval_data, else Instruct.eval_fraction of train_data."""
    ins = cfg.Instruct
    train = read_records(ins.train_data, ins.format, preference, "Instruct.train_data")
    if ins.eval_data:
        if ins.eval_fraction:
            raise ConfigError("Instruct.eval_fraction: give either eval_data files or a fraction, not both")
        return train, read_records(ins.eval_data, ins.format, preference, "Instruct.eval_data")
    return split_records(train, ins.eval_fraction, cfg.Global.seed)


def encode(rec: Record, template: ChatTemplate, tokenizer, train_on_inputs: bool):
    """One SFT record → ids + learned-token mask."""
    if rec.messages is not None:
        return template.encode(tokenizer, rec.messages, train_on_inputs)
    return encode_plain(tokenizer, rec.prompt, rec.completion, train_on_inputs)


def row_length(cfg: Config, model: nn.Module) -> int:
    """Data.Train.dataset.max_seq_len, at most the model's positions (recorded in the config)."""
    n = min(cfg.Data.Train.dataset.max_seq_len, model.wpe.weight.shape[0])
    cfg.Data.Train.dataset.max_seq_len = cfg.Data.Eval.dataset.max_seq_len = n
    return n


def plan_steps(cfg: Config, train_rows: int, eval_rows: int) -> int:
    """Set Engine.max_steps (epochs or Instruct.max_steps), the lr decay over them, and an
    evaluation that covers the validation set at the end (and every eval_freq steps)."""
    e, gbs = cfg.Engine, cfg.Global.global_batch_size
    if train_rows < gbs:
        raise DataError(f"Instruct.train_data: {train_rows} training rows make no batch of Global.global_batch_size "
                        f"{gbs}; lower the batch or add data")
    steps = cfg.Instruct.max_steps or max(1, train_rows // gbs)
    e.max_steps = steps
    cfg.Optimizer.lr.decay_steps = steps
    if eval_rows:
        if eval_rows < gbs:
            raise DataError(f"Instruct.eval_data: {eval_rows} validation rows make no batch of {gbs}; lower "
                            "Global.global_batch_size or hold out more")
        e.eval_iters = eval_rows // gbs
        e.eval_freq = min(e.eval_freq, steps) if e.eval_freq > 0 else steps
    else:
        e.eval_freq = 0
    return steps


def apply_method(cfg: Config, base: Base, echo: bool) -> None:
    """`Instruct.method: lora`: adapters on the base (frozen) from `Instruct.lora`; `full`: nothing."""
    if cfg.Instruct.method != "lora":
        return
    from gptforge.adapters import apply_lora, describe

    # The adapters' initial A comes from Global.seed alone (not from whatever the process drew
    # before), so a run started afresh and the run it resumes begin from the same adapters.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.Global.seed)
        apply_lora(base.model, cfg.Instruct.lora, key="Instruct.lora")
    if echo:
        print(f"gptforge {cfg.Instruct.method}: {describe(base.model)}", flush=True)


def save_outputs(cfg: Config, base: Base, trainer: Trainer) -> Path | None:
    """After a LoRA run: OUT/adapter, a PEFT adapter directory (+ the tokenizer and its template)."""
    if cfg.Instruct.method != "lora":
        return None
    from gptforge.adapters.peft_format import save_adapter

    out = save_adapter(trainer.model, trainer.output_dir / "adapter", base_model=str(base.path), overwrite=True)
    base.tokenizer.save(out)
    return out


class SFTTrainer(Trainer):
    """The pretraining loop with packed rows: each example attends only to itself."""

    def _forward_loss(self, batch: dict, model: nn.Module):
        with self.precision.autocast():
            # Sequence parallel splits each row's positions over the ranks: rows keep their length.
            return rows_loss(model, batch, compact=not self.par.sequence_parallel)


def rows_loss(model: nn.Module, batch: dict, compact: bool = True) -> torch.Tensor:
    """The token loss of a batch of rows, computing only what it depends on: the examples
    re-packed without their padding (data/packing.py `compact_batch`), and with a frozen tied
    head (LoRA without a head adapter) the logits of the learned tokens only, no [N, V]
    tensors kept for backward (head_loss.py). Equal to the model's loss over the rows as given."""
    if compact:
        batch = compact_batch(batch)
    mask = rows_attention_mask(batch["segments"])
    head = frozen_head(model)
    if head is not None:
        hidden = model.hidden_states(batch["tokens"], batch["position_ids"], mask)
        return frozen_head_loss(hidden, head, batch["labels"], batch["loss_mask"])
    return model(batch["tokens"], position_ids=batch["position_ids"], attention_mask=mask,
                 labels=batch["labels"], loss_mask=batch["loss_mask"]).loss


def rows_attention_mask(segments: torch.Tensor) -> torch.Tensor | None:
    """The block-diagonal mask of packed rows; None (plain causal attention) when no row holds
    more than one example. Padding only ever follows a row's example, so causal attention
    already keeps the example from seeing it, and the causal kernel saves no [T, T] mask or
    probabilities: with packing off (or a batch of one-example rows) the step is faster and
    leaner for the same loss (only padding positions, which carry no loss, see other tokens)."""
    if int(segments.max()) <= 1:
        return None
    return packed_attention_mask(segments)


@dataclass
class SFTData:
    train: Rows
    eval: Rows | None


def sft_data(cfg: Config, base: Base) -> SFTData:
    """Training and validation rows for `cfg.Instruct` with the base's tokenizer and template."""
    ins = cfg.Instruct
    train_recs, eval_recs = records(cfg, preference=False)
    n = row_length(cfg, base.model)

    def rows(recs, epochs):
        ex = [encode(r, base.template, base.tokenizer, ins.train_on_inputs) for r in recs]
        out = build_rows(ex, n, ins.packing, cfg.Global.seed, epochs)
        if out.examples == 0:
            raise DataError(f"Instruct.train_data: every example is longer than Data.Train.dataset.max_seq_len {n} "
                            "tokens; raise it (up to the model's positions) or shorten the examples")
        return out

    return SFTData(rows(train_recs, ins.epochs), rows(eval_recs, 1) if eval_recs else None)


def sft(cfg: Config, pretrained: str | os.PathLike | None = None, *, resume=None, progress: bool | None = None,
        echo: bool = True, overwrite: bool = False) -> TrainResult:
    """Instruction-tune the model at `pretrained` on `cfg.Instruct.train_data`; step checkpoints
    (model directories with the chat template) go to Engine.save_load.output_dir."""
    check_instruct(cfg)
    base = load_base(cfg, pretrained)
    cfg = base.cfg
    data = sft_data(cfg, base)
    plan_steps(cfg, len(data.train), len(data.eval) if data.eval else 0)
    if echo:
        d = data.train
        print(f"gptforge sft: {d.examples} examples ({d.dropped} longer than a row dropped) in {len(d)} rows of "
              f"{cfg.Data.Train.dataset.max_seq_len} tokens ({d.fill:.0%} filled, packing "
              f"{'on' if cfg.Instruct.packing else 'off'}), {cfg.Engine.max_steps} steps, template "
              f"{base.template.origin}", flush=True)
    apply_method(cfg, base, echo)
    datasets = {"Train": data.train, **({"Eval": data.eval} if data.eval is not None else {})}
    trainer = SFTTrainer(cfg, base.model, base.tokenizer, datasets=datasets, resume=resume, progress=progress,
                         echo=echo, overwrite=overwrite, verb="sft")
    result = trainer.train()
    adapter = save_outputs(cfg, base, trainer)
    if adapter is not None:
        result.metrics["adapter"] = str(adapter)
    return result

