"""`gptforge export`: a model directory as an HF `transformers` directory, ONNX, torch.export or GGUF.

    gptforge export --format hf --ckpt DIR --out hf/ [--max-shard-size 500MB]
    gptforge export --format onnx --ckpt DIR --out onnx/                 # fp32, or INT8 QDQ from a QAT/PTQ/INT8 model
    gptforge export --format torch --ckpt DIR --out pt2/
    gptforge export --format hf --ckpt BASE --adapter LORA_DIR --out hf/  # the adapter merged (docs/lora.md)
    gptforge export --format gguf --ckpt DIR --out model.gguf [--gguf-type f32|f16|q8_0|q4_0|q4_k]   # llama.cpp
    gptforge infer --ckpt onnx/ --prompt "Hello"

ONNX and torch exports are checked against the PyTorch model before anything is written
(docs/export.md).
"""

from __future__ import annotations

import argparse
from collections import Counter

from gptforge.commands.common import add_config_args, add_overwrite_arg
from gptforge.errors import UsageError

FORMATS = ("hf", "onnx", "torch", "gguf")
EXTRA_HINT = "pip install 'gptforge[export]' (onnx, onnxruntime, onnxscript)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Export a model directory (dense, pruned, QAT/PTQ or INT8) as an HF transformers GPT-2 directory, "
                     "an ONNX model with past keys/values (fp32, or INT8 QDQ from a quantized model), a "
                     "torch.export program (.pt2), or a GGUF file for llama.cpp.")
    add_config_args(p, ckpt_help="the model directory to export (ours, HF GPT-2, .pdparams, QAT/PTQ, INT8, pruned)")
    p.add_argument("--format", required=True, metavar="{hf,onnx,torch,gguf}",
                   help="hf: a transformers GPT-2 directory; onnx: the decoding-step graph (fp32 or INT8 QDQ); "
                        "torch: the same step as a torch.export program; gguf: one file for llama.cpp")
    p.add_argument("--out", metavar="DIR", help="output directory (written atomically); gguf: the .gguf file")
    p.add_argument("--gguf-type", metavar="{f32,f16,q8_0,q4_0,q4_k}",
                   help="gguf: how the 2-D weights are stored (default f32; q4_0 keeps the tied head at q8_0; "
                   "q4_k: llama.cpp's Q4_K_M, made by its own quantizer: needs llama-cpp-python)")
    p.add_argument("--precision", default="auto", metavar="{auto,fp32,int8}",
                   help="onnx/torch: auto (default) = int8 for a quantized model, else fp32; fp32 folds a quantized "
                        "model's weights (activations stay float)")
    p.add_argument("--qdq-dtype", default="uint8", choices=("uint8", "int8", "auto"),
                   help="onnx int8: store the integers as uint8 + 128 (default; onnxruntime's u8 kernels, exact on "
                        "every CPU), as int8 (the reference's form; its fused s8 kernels saturate on x86 without "
                        "VNNI), or auto (int8 where a probe finds this CPU's s8 kernel exact, else uint8)")
    p.add_argument("--max-shard-size", metavar="SIZE",
                   help="hf: split model.safetensors into shards of at most SIZE (e.g. 500MB; default 5GB)")
    p.add_argument("--no-check", action="store_true", help="onnx/torch: skip the check against the PyTorch model")
    p.add_argument("--adapter", dest="merge_adapter", metavar="DIR",
                   help="a LoRA/DoRA adapter directory (PEFT format) to merge into the model before exporting "
                        "(as `gptforge merge`)")
    add_overwrite_arg(p)


def check_export_extra() -> None:
    """The `export` extra is importable, or a one-line error naming the install command."""
    for name in ("onnx", "onnxruntime", "onnxscript"):
        try:
            __import__(name)
        except ImportError:
            raise UsageError(f"--format onnx needs the {name} package, which is not installed: {EXTRA_HINT}") from None


def _validate(args: argparse.Namespace) -> None:
    if args.format not in FORMATS:
        raise UsageError(f"--format {args.format!r}: choose one of {', '.join(FORMATS)}")
    if not args.ckpt:
        raise UsageError("give the model to export with --ckpt DIR")
    if not args.out:
        raise UsageError("give the output directory with --out DIR")
    if args.format == "gguf":
        _validate_gguf(args)
    elif args.gguf_type is not None:
        raise UsageError("--gguf-type applies to --format gguf")
    if args.format == "hf":
        if args.precision != "auto":
            raise UsageError("--precision applies to --format onnx/torch; an HF export is always float "
                             "(quantized weights are folded)")
        if args.no_check:
            raise UsageError("--no-check applies to --format onnx/torch")
    elif args.max_shard_size is not None:
        raise UsageError("--max-shard-size applies to --format hf")
    if args.format != "onnx" and args.qdq_dtype != "uint8":
        raise UsageError("--qdq-dtype applies to --format onnx")


def _validate_gguf(args: argparse.Namespace) -> None:
    from gptforge.commands.common import ensure_out_file
    from gptforge.export.gguf import check_gguf_type, llama_quantizer

    args.gguf_type = check_gguf_type(args.gguf_type or "f32")
    llama_quantizer(args.gguf_type)  # before the model loads: the optional extra it needs
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise UsageError("--format gguf needs the gguf package, which is not installed: "
                         "pip install 'gptforge[export]'") from None
    if args.precision != "auto" or args.no_check:
        raise UsageError(f"--{'precision' if args.precision != 'auto' else 'no-check'} applies to --format onnx/torch; "
                         "a GGUF file's precision is --gguf-type")
    if not str(args.out).endswith(".gguf"):
        raise UsageError(f"--out {args.out}: a GGUF export is one file; name it FILE.gguf")
    ensure_out_file(args.out, args.force)


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.common import config_from_args, ensure_out_dir, load_model_and_tokenizer
    from gptforge.export.common import PRECISIONS
    from gptforge.model_io import resolve_checkpoint_path

    _validate(args)
    if args.precision not in PRECISIONS:
        raise UsageError(f"--precision {args.precision!r}: choose one of {', '.join(PRECISIONS)}")
    if args.max_shard_size is not None:
        from gptforge.export.hf import parse_size

        parse_size(args.max_shard_size)
    ckpt = resolve_checkpoint_path(args.ckpt)  # a missing checkpoint is reported before anything else loads
    if args.merge_adapter:
        from gptforge.adapters.peft_format import adapter_digest

        adapter_digest(args.merge_adapter)  # so is a missing or broken adapter
    from gptforge.finetune.classifier import is_classifier_dir
    from gptforge.run_lock import lock_output

    with lock_output(args.out, "export"):  # a second writer of --out fails at once, naming this one
        if args.format != "gguf":  # a file, checked by _validate_gguf
            ensure_out_dir(args.out, args.force)
        if args.format == "onnx":
            check_export_extra()
        cfg = config_from_args(args)
        if is_classifier_dir(ckpt):
            if args.merge_adapter:
                raise UsageError("--adapter applies to language models; this checkpoint is a classifier")
            return _classifier(ckpt, cfg, args)
        model, cfg, tok = load_model_and_tokenizer(args, cfg, device="cpu")
        args.merge_info = None
        if args.merge_adapter:
            from gptforge.commands.merge import merge_into

            args.merge_info = merge_into(model, ckpt, args.merge_adapter)
        # ensure_out_dir accepted --out (absent, empty or --force): the export replaces it atomically.
        if args.format == "hf":
            return _hf(model, cfg, tok, args)
        if args.format == "gguf":
            return _gguf(model, cfg, tok, args)
        return _program(model, cfg, tok, args)


def _hf(model, cfg, tok, args) -> int:
    from gptforge.export.hf import DEFAULT_MAX_SHARD_SIZE, save_hf
    from gptforge.progress import task

    with task("export: HF safetensors directory"):
        r = save_hf(model, args.out, tok, generation=cfg.Generation, model_cfg=cfg.Model,
                    max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE, overwrite=True)
    shards = [f for f in r.files if f.endswith(".safetensors")]
    notes = []
    if args.merge_info is not None:
        from gptforge.commands.merge import describe, record_hf

        record_hf(args.out, args.merge_info.records)
        notes.append(describe(args.merge_info))
    if r.source_kind != "float":
        notes.append(f"{r.source_kind} model: weights folded to float, activations float")
    if r.zero_padded:
        notes.append("per-layer shapes zero-padded to GPT-2's uniform shape")
    print(f"gptforge export: hf, {len(shards)} weight file(s), n_head {r.n_head}, n_inner {r.n_inner}"
          f"{'; ' + '; '.join(notes) if notes else ''} -> {r.out_dir}")
    return 0


def _gguf(model, cfg, tok, args) -> int:
    from gptforge.export.gguf import save_gguf
    from gptforge.progress import task

    with task(f"export: GGUF {args.gguf_type}"):
        r = save_gguf(model, args.out, tok, args.gguf_type, model_cfg=cfg.Model)
    notes = [f"{r.source_kind} model: weights folded to float"] if r.source_kind != "float" else []
    if r.zero_padded:
        notes.append("per-layer shapes zero-padded to GPT-2's uniform shape")
    if r.dropped_rows:
        notes.append(f"{r.dropped_rows} padded-vocabulary rows left out")
    if r.f16_fallback:
        notes.append(f"{len(r.f16_fallback)} tensor(s) stored f16 (rows not whole blocks)")
    if r.gguf_type == "q4_k":  # llama.cpp's mix: which matrices got which type
        kinds = Counter(t for n, t in r.tensor_types.items() if n.endswith(".weight") and t not in ("F32",))
        notes.append("llama.cpp Q4_K_M: " + ", ".join(f"{n} {t}" for t, n in sorted(kinds.items())))
    print(f"gptforge export: gguf {r.gguf_type}, gpt2, {r.n_vocab} tokens, n_head {r.n_head}, n_inner {r.n_inner}, "
          f"{r.bytes / 2**20:.1f} MiB{'; ' + '; '.join(notes) if notes else ''} -> {r.path}")
    return 0


def _program(model, cfg, tok, args) -> int:
    from gptforge.progress import task

    with task(f"export: {args.format} (trace, write{'' if args.no_check else ', check against PyTorch'})"):
        r = _export_program(model, cfg, tok, args)
    return _report_program(r, args)


def _export_program(model, cfg, tok, args):
    if args.format == "onnx":
        from gptforge.export.onnx import export_onnx

        r = export_onnx(model, args.out, tok, cfg=cfg, precision=args.precision, qdq_dtype=args.qdq_dtype,
                        check=not args.no_check, overwrite=True)
    else:
        from gptforge.export.torch_export import export_torch

        r = export_torch(model, args.out, tok, cfg=cfg, precision=args.precision, check=not args.no_check,
                         overwrite=True)
    return r


def _report_program(r, args) -> int:
    c = r.check
    check = (f"; check on {c['positions']} positions (prefill {c['prefill_tokens']} + {c['decode_steps']} cached "
             f"steps): max |logit diff| {c['max_abs_diff']:.2e}, argmax agreement {100 * c['argmax_agreement']:.2f}%"
             if c else "; not checked")
    exact = c.get("fp64_agreement")
    if exact:
        check += f" (vs fp64 arithmetic: export {100 * exact['export']:.1f}%, PyTorch {100 * exact['pytorch']:.1f}%)"
    src = f" from a {r.source_kind} model" if r.source_kind != "float" else ""
    gemm = f", int8 GEMMs {c['int8_gemm']}" if c.get("int8_gemm") not in (None, "n/a") else ""
    print(f"gptforge export: {args.format} {r.precision}{src}, {r.num_layers} layers{check}{gemm} "
          f"({r.seconds:.1f} s) -> {r.out_dir}")
    return 0


def _classifier(ckpt, cfg, args) -> int:
    """A fine-tuned classifier (`gptforge finetune`): GPT2ForSequenceClassification or ONNX logits."""
    from gptforge.finetune.classifier import load_classifier

    if args.format in ("torch", "gguf"):
        raise UsageError(f"--format {args.format} exports language models; export a classifier with --format hf or onnx")
    if args.format == "onnx" and args.precision == "int8":
        raise UsageError("--precision int8: a classifier exports as fp32 ONNX (quantized weights folded)")
    clf, cfg, tok, task = load_classifier(ckpt, cfg, device="cpu")
    if args.format == "hf":
        from gptforge.finetune.export import save_hf_classifier

        r = save_hf_classifier(clf, args.out, tok, task=task, model_cfg=cfg.Model,
                               max_shard_size=args.max_shard_size, overwrite=True)
        print(f"gptforge export: hf GPT2ForSequenceClassification, {r.num_classes} labels, pad_token_id "
              f"{r.pad_token_id}{f', {r.source_kind} weights folded' if r.source_kind != 'float' else ''} -> {r.out_dir}")
        return 0
    from gptforge.finetune.export import export_onnx_classifier

    r = export_onnx_classifier(clf, args.out, tok, cfg=cfg, task=task, check=not args.no_check, overwrite=True)
    c = r.check
    check = f"; check: max |logit diff| {c['max_abs_diff']:.2e}" if c else "; not checked"
    print(f"gptforge export: onnx classifier fp32, {r.num_classes} logits{check} ({r.seconds:.1f} s) -> {r.out_dir}")
    return 0
