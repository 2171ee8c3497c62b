"""Arguments and helpers shared by the verbs: `-c/-o/--ckpt`, the sampling flags, device choice,
model loading."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from gptforge.device import select_device  # noqa: F401 - re-exported for the verbs
from gptforge.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover

    from gptforge.config import Config


def add_config_args(p: argparse.ArgumentParser, ckpt: bool = True, ckpt_help: str | None = None) -> None:
    """`-c FILE`, repeatable `-o Section.key=value`, and (optionally) `--ckpt DIR`."""
    p.add_argument("-c", "--config", metavar="FILE", help="YAML config (may use _base_ inheritance), or the name of "
                   "a recipe shipped with gptforge (`gptforge config list`)")
    p.add_argument("-o", "--override", metavar="KEY=VALUE", action="append", default=[],
                   help="override a config key, e.g. -o Engine.max_steps=100 (repeatable)")
    if ckpt:
        p.add_argument("--ckpt", metavar="DIR", help=ckpt_help or (
            "model directory: ours, an HF GPT-2 directory, or a PaddleFleetX model.pdparams; "
            "its config and tokenizer are used, so -c is optional"))


class _AsOverride(argparse.Action):
    """A flag that is an `-o KEY=VALUE` spelled out: it appends to the same list as `-o`, in
    command-line order, so the config stays the one source of truth (and `config show` shows it)
    and, as with two `-o` of one key, the later one on the command line wins."""

    def __init__(self, option_strings, dest, key: str, **kwargs):
        self.key = key
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, "override", None) or [])
        items.append(f"{self.key}={values}")
        namespace.override = items
        setattr(namespace, self.dest, values)


# (flag, config key, type, help): the generation flags of `generate`, `infer`, `serve` (and `chat`).
SAMPLING_FLAGS = (
    ("--max-new-tokens", "Generation.max_dec_len", int, "N", "tokens to generate at most"),
    ("--temperature", "Generation.temperature", float, "T", "sampling temperature (> 0)"),
    ("--top-k", "Generation.top_k", int, "K", "sample from the K most likely tokens (0 = off)"),
    ("--top-p", "Generation.top_p", float, "P", "nucleus sampling: the smallest set of tokens with probability >= P "
                                               "(1.0 = off)"),
    ("--seed", "Generation.seed", int, "N", "seed of the sampling RNG (default: torch's global RNG)"),
    ("--kv-cache-dtype", "Generation.kv_cache_dtype", str, "DTYPE", "KV cache storage: auto (the model's dtype) | "
                                                                   "float32 | bfloat16 | int8 (docs/generate.md)"),
    ("--device", "Global.device", str, "DEV", "auto | cpu | cuda | cuda:N"),
)


class _Refused(argparse.Action):
    """A sampling flag on a verb that cannot honour it yet: one line saying why, exit 2 (never
    accepted and ignored)."""

    def __init__(self, option_strings, dest, reason: str, **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.reason}")


def add_sampling_args(p: argparse.ArgumentParser, device_help: str | None = None,
                      refuse_sampling: str | None = None) -> None:
    """The flags LitGPT / transformers users type (`--max-new-tokens`, `--temperature`, `--top-k`,
    `--top-p`, `--seed`, `--device`), each `-o KEY=VALUE` spelled out (docs/cli.md), the same on
    every verb that generates. `refuse_sampling`: why this verb refuses all but `--device`."""
    g = p.add_argument_group("generation (each flag is the -o override it names; the later of a flag and an -o "
                             "of the same key wins)")
    for flag, key, typ, metavar, text in SAMPLING_FLAGS:
        dest = f"flag_{flag[2:].replace('-', '_')}"
        if flag == "--device" and device_help:
            text = device_help
        if refuse_sampling and flag != "--device":
            g.add_argument(flag, action=_Refused, reason=refuse_sampling, metavar=metavar, dest=dest,
                           default=None, help=f"{text}: not on this verb ({refuse_sampling})")
            continue
        g.add_argument(flag, action=_AsOverride, key=key, type=typ, metavar=metavar, dest=dest,
                       default=None, help=f"{text} (= -o {key}={metavar})")


def add_run_dir_arg(p: argparse.ArgumentParser, what: str = "checkpoints step_N, metrics.jsonl, train.log") -> None:
    """`--out DIR` for the training verbs: the run directory (= -o Engine.save_load.output_dir=DIR,
    and it wins over the YAML and -o)."""
    p.add_argument("--out", dest="run_dir_out", metavar="DIR", help=(
        f"run directory for {what} (default: Engine.save_load.output_dir of the config, ./output unless the "
        "recipe says otherwise)"))


def run_dir_overrides(args: argparse.Namespace) -> list[str]:
    """-o overrides with `--out DIR` applied last, so it wins."""
    out = getattr(args, "run_dir_out", None)
    return [*args.override, f"Engine.save_load.output_dir={out}"] if out else list(args.override)


def config_from_args(args: argparse.Namespace, require: bool = False, world_size: int | None = None) -> Config:
    """Resolved config from -c/-o/--ckpt (and a training verb's --out); `require` demands -c or --ckpt."""
    from gptforge.model_io import load_run_config

    ckpt = getattr(args, "ckpt", None)
    if require and not args.config and not ckpt:
        raise UsageError("give a config with -c FILE or -c RECIPE (e.g. -c pretrain_gpt_tiny_cpu; "
                         "`gptforge config list` shows them), or a model with --ckpt DIR")
    return load_run_config(args.config, run_dir_overrides(args), ckpt_dir=ckpt, world_size=world_size)


def require_ckpt(args: argparse.Namespace, flag: str = "--ckpt") -> str:
    path = getattr(args, "ckpt", None)
    if not path:
        raise UsageError(f"give a model with {flag} DIR")
    return path


def add_adapter_arg(p: argparse.ArgumentParser) -> None:
    """`--adapter DIR`: a LoRA/DoRA adapter applied over `--ckpt` by `load_model_and_tokenizer`."""
    p.add_argument("--adapter", metavar="DIR", help="a LoRA/DoRA adapter directory (PEFT format: ours or peft's) "
                   "applied over --ckpt (docs/lora.md)")


def add_chat_template_arg(p) -> None:
    """`--chat-template FILE` of the verbs that render conversations (chat, generate --chat)."""
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (.jinja, or a tokenizer_config.json "
                   "with chat_template) instead of the model's own (default: the one saved with the adapter or "
                   "model, else gptforge's default; docs/sft.md)")


def load_model_and_tokenizer(args: argparse.Namespace, cfg: Config, device=None):
    """(model in eval mode, config with the checkpoint's shape, tokenizer) for `--ckpt`, with
    `--adapter DIR` (when the verb has it) applied."""
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import load_model, resolve_checkpoint_path

    path = resolve_checkpoint_path(require_ckpt(args))
    model, cfg = load_model(path, cfg, device=device)
    if getattr(args, "adapter", None):
        from gptforge.adapters.peft_format import apply_adapter

        model = apply_adapter(model, args.adapter)
    tok = load_tokenizer(cfg.Data.tokenizer, path if path.is_dir() else None)
    return model, cfg, tok


def add_overwrite_arg(p: argparse.ArgumentParser, what: str = "--out") -> None:
    """`--force` of a verb that writes `--out` whole: without it an existing output is refused
    before any work (`ensure_out_file` / `ensure_out_dir`); with it the output is replaced."""
    p.add_argument("--force", action="store_true",
                   help=f"overwrite {what} if present (default: refuse, before doing any work)")


def refuse_existing(paths, force: bool, flag: str = "--out") -> None:
    """UsageError naming the first of `paths` that exists, unless `force`: the one check of every
    verb that would overwrite an output (docs/cli.md)."""
    if force:
        return
    for path in paths:
        if os.path.lexists(path):
            raise UsageError(f"{path}: already exists; pass --force to overwrite it, or choose another {flag}")


def ensure_out_file(path: str | os.PathLike, force: bool, flag: str = "--out") -> None:
    """Refuse to overwrite an existing output file unless --force, and a directory always."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory, expected a file; choose another {flag}")
    refuse_existing([path], force, flag)


def ensure_out_dir(path: str | os.PathLike, force: bool) -> None:
    """Refuse to overwrite an existing non-empty output directory unless --force, and a file always."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out {path}: is a file, expected a directory; choose another --out")
    if os.path.isdir(path) and os.listdir(path):
        refuse_existing([path], force)
