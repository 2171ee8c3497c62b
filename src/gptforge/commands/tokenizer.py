"""`gptforge tokenizer`: train a byte-level BPE tokenizer, or inspect / use one."""

from __future__ import annotations

import argparse
import sys

from gptforge.commands.common import add_overwrite_arg
from gptforge.errors import UsageError


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="SPEC", help="gpt2 | a tokenizer directory | tokenizer.json (default gpt2)")
    p.add_argument("--ckpt", metavar="DIR", help="use the tokenizer stored in this model directory")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="<action>", parser_class=type(p))
    t = sub.add_parser("train", help="learn a byte-level BPE vocabulary from text (EOS <|endoftext|> = last id)")
    src = t.add_mutually_exclusive_group()
    src.add_argument("--input", nargs="+", metavar="PATH", help="text / jsonl files, directories or globs")
    src.add_argument("--builtin", action="store_true", help="the built-in corpus (this Python's standard library)")
    t.add_argument("--vocab-size", type=int, default=8192, metavar="N", help="tokens including <|endoftext|> (default 8192)")
    t.add_argument("--min-frequency", type=int, default=2, metavar="N", help="merge pairs seen at least N times (default 2)")
    t.add_argument("--json-key", default="text", metavar="KEY", help="jsonl field holding the text")
    t.add_argument("--min-doc-length", type=int, default=10, metavar="N", help="skip documents of <= N characters")
    t.add_argument("--out", required=True, metavar="DIR", help="directory for tokenizer.json, vocab.json, merges.txt")
    add_overwrite_arg(t)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = sub.add_parser("show", help="vocabulary size, EOS id, fingerprint and an example")
    _source_args(s)
    e = sub.add_parser("encode", help="print the token ids of TEXT (or of stdin)")
    _source_args(e)
    e.add_argument("text", nargs="*", help="text to encode (default: read stdin)")
    d = sub.add_parser("decode", help="print the text of token IDS")
    _source_args(d)
    d.add_argument("ids", nargs="+", type=int, help="token ids")


def _load(args: argparse.Namespace):
    from gptforge.data.tokenizer import load_tokenizer

    if args.ckpt:
        from gptforge.model_io import resolve_checkpoint_path

        path = resolve_checkpoint_path(args.ckpt)
        return load_tokenizer(args.tokenizer, path if path.is_dir() else None)
    return load_tokenizer(args.tokenizer)


def _train(args: argparse.Namespace) -> int:
    from gptforge.run_lock import lock_output

    with lock_output(args.out, "tokenizer"):  # a second writer of --out fails at once, naming this one
        return _train_locked(args)


def _train_locked(args: argparse.Namespace) -> int:
    import time

    from gptforge.commands.common import ensure_out_dir
    from gptforge.data.tokenizer import train_tokenizer
    from gptforge.model_io import atomic_dir

    if not args.input and not args.builtin:
        raise UsageError("give --input FILE/DIR/GLOB ... or --builtin")
    ensure_out_dir(args.out, args.force)
    t0 = time.perf_counter()
    if args.builtin:
        from gptforge.data.corpus import builtin_documents

        docs = builtin_documents()
    else:
        from gptforge.data.preprocess import iter_documents

        docs = iter_documents(args.input, json_key=args.json_key, min_doc_length=args.min_doc_length)
    from gptforge import progress

    # tokenizers' own bar draws on a terminal only; elsewhere it prints bare newlines to stdout
    # (where the result line goes), so redirected runs get gptforge's plain lines instead.
    bar = not args.no_progress and progress.mode() == "bar"
    with progress.task("tokenizer: training BPE", enabled=not bar and not args.no_progress):
        tok = train_tokenizer(docs, args.vocab_size, min_frequency=args.min_frequency, show_progress=bar)
    with atomic_dir(args.out, overwrite=args.force) as tmp:
        tok.save(tmp)
    print(f"trained a byte-level BPE tokenizer: {tok.vocab_size} tokens, <|endoftext|> = {tok.eos_token_id}, "
          f"in {time.perf_counter() - t0:.1f} s -> {args.out} (use it with --tokenizer {args.out} "
          f"or -o Data.tokenizer={args.out})")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action is None:
        raise UsageError("choose an action: train, show, encode or decode (see gptforge tokenizer --help)")
    if args.action == "train":
        return _train(args)
    tok = _load(args)
    if args.action == "show":
        example = "Hello world! <|endoftext|>"
        print(f"tokenizer: {tok.name}\nvocab_size: {tok.vocab_size}\neos_token_id: {tok.eos_token_id}\n"
              f"gpt2_vocabulary: {tok.is_gpt2()}\nfingerprint: {tok.fingerprint()}\n"
              f"example: {example!r} -> {tok.encode(example)}")
    elif args.action == "encode":
        text = " ".join(args.text) if args.text else sys.stdin.read()
        print(" ".join(map(str, tok.encode(text))))
    else:
        bad = [i for i in args.ids if not 0 <= i < tok.vocab_size]
        if bad:
            raise UsageError(f"ids {bad[:5]} outside the vocabulary [0, {tok.vocab_size})")
        sys.stdout.write(tok.decode(args.ids) + "\n")
    return 0
