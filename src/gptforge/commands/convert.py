"""`gptforge convert`: HF GPT-2 / PaddleFleetX .pdparams / GGUF (gpt2) / our directories → ours or HF.

A distributed step checkpoint (torch.distributed.checkpoint shards written by a multi-process
`pretrain`) becomes a single-file model directory: the shards are read and joined in this one
process, and the written config drops the run's parallel layout (`Distributed` back to its
defaults), since one file has none.
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_overwrite_arg, ensure_out_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", "--src", dest="src", required=True, metavar="PATH",
                   help="source: our model dir (a distributed step_N checkpoint too), an HF GPT-2 dir, "
                        "a model.pdparams (or its dir), a gpt2 .gguf file (dequantized); --src is the older spelling")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--to", choices=("gptforge", "hf"), default="gptforge", help="output format (default: gptforge)")
    p.add_argument("--tokenizer", metavar="SPEC", help="tokenizer to store with the model (default: the source's, else gpt2)")
    add_overwrite_arg(p)
    add_config_args(p, ckpt=False)


def run(args: argparse.Namespace) -> int:
    from gptforge.run_lock import lock_output

    with lock_output(args.out, "convert"):  # a second writer of --out fails at once, naming this one
        if str(args.src).endswith(".gguf"):  # read through a temporary HF directory: one loader of layouts
            from gptforge.export.gguf_read import gguf_as_hf_dir

            ensure_out_dir(args.out, args.force)
            with gguf_as_hf_dir(args.src) as hf_dir:
                return _convert(argparse.Namespace(**{**vars(args), "src": str(hf_dir)}), shown=args.src)
        return _convert(args)


def _convert(args: argparse.Namespace, shown: str | None = None) -> int:
    import dataclasses

    from gptforge.config import DistributedConfig
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.dcp_read import is_distributed_checkpoint
    from gptforge.model_io import (
        load_model,
        load_run_config,
        resolve_checkpoint_path,
        save_hf_dir,
        save_model_dir,
    )
    from gptforge.progress import task

    ensure_out_dir(args.out, args.force)
    src = resolve_checkpoint_path(args.src)
    cfg = load_run_config(args.config, args.override, ckpt_dir=src)
    with task(f"convert: reading {src.name}"):
        model, cfg = load_model(src, cfg)
    sharded = src.is_dir() and is_distributed_checkpoint(src)
    if sharded:
        cfg = dataclasses.replace(cfg, Distributed=DistributedConfig())
    tok = load_tokenizer(args.tokenizer or cfg.Data.tokenizer, src if src.is_dir() else None)
    with task(f"convert: writing {args.to}"):
        if args.to == "hf":
            save_hf_dir(model, cfg, args.out, tokenizer=tok, overwrite=args.force)
        else:
            save_model_dir(model, cfg, args.out, tokenizer=tok, overwrite=args.force)
    n = sum(p.numel() for p in model.parameters())
    what = f"{args.to}, {n / 1e6:.2f}M parameters" + (", joined from a distributed checkpoint" if sharded else "")
    print(f"converted {shown or src} -> {args.out} ({what})")
    return 0
