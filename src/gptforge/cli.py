"""`gptforge <verb>`: a thin layer over the Python API, one module per verb.

Each verb lives in `gptforge/commands/<verb>.py` with `add_arguments(parser)` and
`run(args) -> int`. Only the chosen verb's module is imported, so `--help` stays fast and a
verb's heavy dependencies load only when it runs. User errors (`GPTForgeError`) print one line
and exit with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import signal
import sys

from gptforge import __version__, progress
from gptforge.errors import GPTForgeError
from gptforge.fsguard import disk_full_errno, disk_full_error

# verb -> (module, one-line help). Order is the order of the life cycle.
VERBS: dict[str, tuple[str, str]] = {
    "preprocess": ("gptforge.commands.preprocess", "tokenize raw text / jsonl into <prefix>_ids.npy + <prefix>_idx.npz"),
    "tokenizer": ("gptforge.commands.tokenizer", "train or inspect a byte-level BPE tokenizer"),
    "pretrain": ("gptforge.commands.pretrain", "pretrain or continue training a GPT model"),
    "finetune": ("gptforge.commands.finetune", "fine-tune for GLUE sequence classification (local TSV files)"),
    "sft": ("gptforge.commands.sft", "instruction-tune on chat / instruction data (templates, packing)"),
    "dpo": ("gptforge.commands.dpo", "preference-tune with DPO on prompt/chosen/rejected pairs"),
    "generate": ("gptforge.commands.generate", "generate text (sampling, greedy, beam search)"),
    "chat": ("gptforge.commands.chat", "chat with a model: multi-turn, streamed, through its chat template"),
    "eval": ("gptforge.commands.eval", "LAMBADA cloze accuracy, WikiText perplexity, lm-eval tasks"),
    "ptq": ("gptforge.commands.ptq", "post-training INT8 quantization (calibrate scales, no training)"),
    "qat": ("gptforge.commands.qat", "INT8 quantization-aware training"),
    "quantize": ("gptforge.commands.quantize", "convert a QAT/PTQ model into a real INT8 model"),
    "analyze": ("gptforge.commands.analyze", "per-layer quantization sensitivity analysis"),
    "prune": ("gptforge.commands.prune", "structured pruning (heads, FFN neurons) + fine-tuning; 2:4 sparsity"),
    "merge": ("gptforge.commands.merge", "merge a LoRA/DoRA adapter into its base model (model or HF directory)"),
    "export": ("gptforge.commands.export", "export to an HF directory, ONNX (fp32/INT8) or torch.export"),
    "infer": ("gptforge.commands.infer", "generate text with an exported ONNX model (onnxruntime)"),
    "serve": ("gptforge.commands.serve", "OpenAI-compatible HTTP server with continuous batching"),
    "convert": ("gptforge.commands.convert", "convert checkpoints: HF GPT-2, PaddleFleetX .pdparams, distributed"),
    "demo": ("gptforge.commands.demo", "the whole life cycle on the built-in corpus, with a report"),
    "config": ("gptforge.commands.config", "list the packaged recipes, show a config, list every key"),
    "docs": ("gptforge.commands.docs", "print a documentation page shipped with gptforge (gptforge docs <verb>)"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line (exit 2)."""

    def error(self, message: str):  # noqa: D401
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gptforge",
        description="gptforge: pretrain, generate, evaluate, compress and export GPT models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=("Run `gptforge <verb> --help` for a verb's options.\n"
                "Recipes shipped with gptforge: `gptforge config list`; use one with -c NAME.\n"
                "Docs: `gptforge docs <verb>` prints a verb's page (shipped with gptforge); `gptforge docs` lists them."),
    )
    parser.add_argument("--version", action="version", version=f"gptforge {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="<verb>", parser_class=_Parser)
    for name, (module, help_text) in VERBS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           epilog=f"Docs: gptforge docs {name}" if name != "docs" else None)
        if name == verb:
            importlib.import_module(module).add_arguments(p)
            add_output_conventions(p)
    return parser


def add_output_conventions(p: argparse.ArgumentParser) -> None:
    """`--no-progress` and `--quiet` on every verb, meaning the same everywhere (docs/cli.md).
    A verb with sub-commands (`tokenizer train`, `config show`) gets them on each sub-command."""
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if subs:
        for action in subs:
            for child in set(action.choices.values()):
                add_output_conventions(child)
        return
    if "--no-progress" not in p._option_string_actions:
        p.add_argument("--no-progress", action="store_true",
                       help="no progress bars or periodic progress lines")
    if "--quiet" not in p._option_string_actions:
        p.add_argument("--quiet", action="store_true",
                       help="no progress and no informational lines: only results and errors")


def _first_positional(argv: list[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def _print_error(verb: str, e: Exception) -> int:
    msg = " ".join(str(e).split())
    print(f"gptforge {verb}: error: {msg}", file=sys.stderr)
    return 2


def _ignore_file_size_signal() -> None:
    """Past `ulimit -f` the kernel sends SIGXFSZ, whose default kills the process with no word;
    ignored, the write fails with EFBIG and is reported like a full disk."""
    if hasattr(signal, "SIGXFSZ"):
        with contextlib.suppress(ValueError):  # not the main thread (cli.main called from a thread)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _unknown_verb(verb: str) -> int:
    match = difflib.get_close_matches(verb, list(VERBS), n=1, cutoff=0.5)
    hint = f" (did you mean {match[0]}?)" if match else ""
    print(f"gptforge: error: unknown verb {verb!r}{hint} (see gptforge --help)", file=sys.stderr)
    return 2


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)command parser that `args` was parsed by: `gptforge generate`, `gptforge tokenizer train`."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = next((a.choices[getattr(args, a.dest)] for a in subs
                       if getattr(args, a.dest, None) in a.choices), None)
        if chosen is None:
            return parser
        parser = chosen


def _reject_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> None:
    """Unrecognized arguments, reported by the verb that got them, pointing at its --help."""
    leaf = _leaf_parser(parser, args)
    hint = ""
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("--")]
    if len(flags) == 1:
        known = [o for o in leaf._option_string_actions if o.startswith("--")]
        match = difflib.get_close_matches(flags[0].replace("_", "-"), known, n=1, cutoff=0.75)
        hint = f" (did you mean {match[0]}?)" if match else ""
    leaf.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def _quiet_closed_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the interpreter's final flush does not
    print a second BrokenPipeError."""
    import os

    with contextlib.suppress(AttributeError, OSError, ValueError):
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = _first_positional(argv)
    if verb is not None and verb not in VERBS:
        return _unknown_verb(verb)
    parser = build_parser(verb)
    args, extras = parser.parse_known_args(argv)
    if extras:
        _reject_unknown(parser, args, extras)
    if args.verb is None:
        parser.print_help()
        return 2
    _ignore_file_size_signal()
    module = importlib.import_module(VERBS[args.verb][0])
    args.run_verb = main  # a verb may run other verbs in this process (the demo's stages): handed down
    quiet = bool(getattr(args, "quiet", False))
    if quiet:
        args.no_progress = True
    try:
        with progress.settings(no_progress=bool(getattr(args, "no_progress", False)), quiet_=quiet):
            return int(module.run(args) or 0)
    except GPTForgeError as e:
        return _print_error(args.verb, e)
    except BrokenPipeError:  # `gptforge ... | head`: the reader has what it wanted
        _quiet_closed_stdout()
        return 0
    except Exception as e:
        # Last resort for a write site that does not translate a full disk itself.
        code = disk_full_errno(e)
        if code is None:
            raise
        where = getattr(e, "filename", None) or "an output file (path not reported by the writer)"
        return _print_error(args.verb, disk_full_error(where, code, atomic=False))
    except KeyboardInterrupt as e:  # a training run saved first (train/interrupt.py): 128 + the signal
        print(f"gptforge {args.verb}: interrupted{f' ({e})' if str(e) else ''}", file=sys.stderr)
        return int(getattr(e, "exit_code", 130))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
