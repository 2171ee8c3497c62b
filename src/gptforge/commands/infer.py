"""`gptforge infer`: generate text with an exported ONNX model in onnxruntime.

    gptforge export --format onnx --ckpt DIR --out onnx/
    gptforge infer --ckpt onnx/ --prompt "Hello" [--max-new-tokens 40 --top-k 50]
    gptforge infer --ckpt onnx/ --prompt-file prompts.txt --out out.json --batch-size 8

(`--onnx DIR` is the older spelling of `--ckpt DIR`.)

The counterpart of the reference's inference engine. Generation options, prompts, streaming and
output are those of `gptforge generate`; the Generation defaults come from the config saved
with the export (docs/infer.md).
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_sampling_args
from gptforge.commands.generate import add_prompt_arguments
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Generate text with a `gptforge export --format onnx` directory in onnxruntime (fp32 or INT8), "
                     "with the options of `gptforge generate`.")
    add_config_args(p, ckpt=False)
    p.add_argument("--ckpt", "--onnx", dest="onnx", metavar="DIR",
                   help="a `gptforge export --format onnx` output directory (--onnx: the older spelling)")
    add_prompt_arguments(p)
    add_sampling_args(p, device_help="onnxruntime runs on the CPU: auto or cpu (a torch draft model runs there too)")
    p.add_argument("--threads", type=int, metavar="N", help="onnxruntime intra-op threads (default: its own choice)")
    p.add_argument("--int8-gemm", default="auto", choices=("auto", "on", "off"),
                   help="INT8 models: fuse QDQ MatMuls into onnxruntime's int8 GEMMs (auto: where they are exact "
                        "on this CPU; see docs/infer.md)")


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.export import EXTRA_HINT
    from gptforge.commands.generate import check_output, emit, read_prompts, stream_mode
    from gptforge.export.export_dir import load_export_config, read_export_dir
    from gptforge.generate import check_config

    if not args.onnx:
        raise UsageError("give the exported model with --ckpt DIR (made by `gptforge export --format onnx`)")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size: must be >= 1, got {args.batch_size}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads: must be >= 1, got {args.threads}")
    if args.flag_device not in (None, "auto", "cpu"):
        raise UsageError(f"--device {args.flag_device}: gptforge infer runs onnxruntime on the CPU; use auto or cpu "
                         "(or gptforge generate --ckpt MODEL_DIR --device ... for the PyTorch model)")
    check_output(args)
    prompts = read_prompts(args)
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        raise UsageError(f"gptforge infer needs onnxruntime, which is not installed: {EXTRA_HINT}") from None
    path, _ = read_export_dir(args.onnx, "onnx")
    cfg = load_export_config(path, args.config, args.override)
    check_config(cfg.Generation)
    do_stream = stream_mode(args, cfg.Generation, prompts)
    from gptforge.generate.loader import load_draft, load_runnable

    backend, cfg, tok = load_runnable(path, cfg, int8_gemm=args.int8_gemm, threads=args.threads)
    draft = (load_draft(cfg.Generation.draft, tokenizer=tok, target_name=args.onnx, threads=args.threads)
             if cfg.Generation.draft else None)
    return emit(backend, tok, prompts, cfg, args, do_stream, "infer", draft=draft)
