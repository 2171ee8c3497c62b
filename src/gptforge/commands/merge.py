"""`gptforge merge`: fold a LoRA/DoRA adapter into its base model and write the merged model.

    gptforge merge --ckpt BASE --adapter ADAPTER --out merged/               # our model directory
    gptforge merge --ckpt BASE --adapter ADAPTER --out merged-hf/ --format hf
    gptforge export --format hf --ckpt BASE --adapter ADAPTER --out hf/     # the same, from export

The base may be float, QAT/PTQ (the merged float weight stays fake-quantized) or INT8 (the
dequantized weight + the delta is re-quantized: int8 integers cannot hold a float delta; the
logits of the merged INT8 model against the unmerged one are printed). The merged model
records which adapters it holds (`merged_adapters.json`, or `gptforge_merged_adapters` in an
HF config.json), so merging the same adapter again leaves the weights as they are.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from gptforge.commands.common import add_config_args, add_overwrite_arg
from gptforge.errors import CheckpointError, UsageError

RECORD_FILE = "merged_adapters.json"
HF_RECORD_KEY = "gptforge_merged_adapters"
FORMATS = ("model", "hf")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Merge a LoRA/DoRA adapter directory (PEFT format) into its base model: a plain model directory "
                     "(default) or an HF transformers GPT-2 directory.")
    add_config_args(p, ckpt_help="the base model directory (ours, HF GPT-2, QAT/PTQ or INT8)")
    p.add_argument("--adapter", dest="merge_adapter", metavar="DIR", required=True,
                   help="the adapter directory (adapter_config.json + adapter_model.safetensors, ours or peft's)")
    p.add_argument("--out", metavar="DIR", required=True, help="the merged model directory DIR (required; written "
                   "atomically)")
    p.add_argument("--format", default="model", choices=FORMATS,
                   help="model (default): our model directory; hf: a transformers GPT-2 directory")
    add_overwrite_arg(p)


@dataclass
class MergeInfo:
    merged: bool  # False: the base already held this adapter (nothing changed)
    records: list[dict] = field(default_factory=list)
    check: dict | None = None  # INT8 base: merged vs unmerged logits


def merge_records(ckpt: str | Path) -> list[dict]:
    """The adapters a model directory records as merged into it (ours or an HF export)."""
    p = Path(ckpt)
    try:
        if (p / RECORD_FILE).is_file():
            return list(json.loads((p / RECORD_FILE).read_text(encoding="utf-8")))
        if (p / "config.json").is_file():
            return list(json.loads((p / "config.json").read_text(encoding="utf-8")).get(HF_RECORD_KEY) or [])
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{p}: unreadable merge record ({e})") from None
    return []


def _probe_logits(model, vocab: int):
    import torch

    ids = torch.randint(0, vocab, (2, min(64, model.wpe.weight.shape[0])), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(ids).logits.float()


def merge_into(model, ckpt: str | Path, adapter_dir: str | Path) -> MergeInfo:
    """Load the adapter into `model`, merge it and remove the wrappers (in place), unless the
    base at `ckpt` records it as merged already."""
    from gptforge.adapters import merge_adapters, unload
    from gptforge.adapters.peft_format import adapter_digest, load_adapter
    from gptforge.export.common import INT8, model_kind

    digest = adapter_digest(adapter_dir)
    records = merge_records(ckpt)
    if any(r.get("sha256") == digest for r in records):
        return MergeInfo(False, records)
    load_adapter(model, adapter_dir)
    check = None
    if model_kind(model) == INT8:
        vocab = model.wte.num_embeddings
        before = _probe_logits(model, vocab)
        merge_adapters(model)
        after = _probe_logits(model, vocab)
        check = {"max_abs_diff": float((after - before).abs().max()),
                 "argmax_agreement": float((after.argmax(-1) == before.argmax(-1)).float().mean())}
    unload(model)
    return MergeInfo(True, [*records, {"adapter": str(adapter_dir), "sha256": digest}], check)


def record_hf(out_dir: str | Path, records: list[dict]) -> None:
    """Add the merge record to an HF export's config.json (replaced atomically)."""
    from gptforge.durable import write_text_durable

    f = Path(out_dir) / "config.json"
    cfg = json.loads(f.read_text(encoding="utf-8"))
    cfg[HF_RECORD_KEY] = records
    write_text_durable(f, json.dumps(cfg, indent=2) + "\n")


def describe(info: MergeInfo) -> str:
    if not info.merged:
        return "the base already holds this adapter (merged before): weights unchanged"
    c = info.check
    if c is None:
        return "adapter merged"
    return (f"adapter merged into the INT8 weights (re-quantized): merged vs unmerged logits max |diff| "
            f"{c['max_abs_diff']:.3g}, argmax agreement {100 * c['argmax_agreement']:.1f}%")


def run(args: argparse.Namespace) -> int:
    from gptforge.adapters.peft_format import adapter_digest
    from gptforge.commands.common import config_from_args, ensure_out_dir, load_model_and_tokenizer
    from gptforge.model_io import resolve_checkpoint_path
    from gptforge.run_lock import lock_output

    ckpt = resolve_checkpoint_path(args.ckpt) if args.ckpt else None
    if ckpt is None:
        raise UsageError("give the base model with --ckpt DIR")
    adapter_digest(args.merge_adapter)  # a missing or broken adapter is reported before the model loads
    from gptforge.progress import task

    with lock_output(args.out, "merge"), task(f"merge: adapter into the base, write a {args.format} directory"):
        ensure_out_dir(args.out, args.force)
        cfg = config_from_args(args)
        model, cfg, tok = load_model_and_tokenizer(args, cfg, device="cpu")
        info = merge_into(model, ckpt, args.merge_adapter)
        if args.format == "hf":
            from gptforge.export.hf import save_hf

            save_hf(model, args.out, tok, generation=cfg.Generation, model_cfg=cfg.Model, overwrite=True)
            record_hf(args.out, info.records)
        else:
            from gptforge.model_io import atomic_dir, write_model_files

            with atomic_dir(args.out, overwrite=True) as tmp:
                write_model_files(model, cfg, tmp, tok)
                (tmp / RECORD_FILE).write_text(json.dumps(info.records, indent=2) + "\n", encoding="utf-8")
    print(f"gptforge merge: {describe(info)} -> {args.out} ({args.format})")
    return 0
