"""`gptforge preprocess`: tokenize raw text / jsonl into the reference's token files."""

from __future__ import annotations

import argparse

from gptforge.commands.common import add_config_args, add_overwrite_arg
from gptforge.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input", "--input_path", nargs="+", metavar="PATH",
                     help="text (.txt: documents split on blank lines) or jsonl (.jsonl, .jsonl.zst) files, "
                          "directories (searched recursively) or glob patterns; read in sorted order")
    src.add_argument("--builtin", action="store_true",
                     help="the built-in corpus: this Python's standard library (docstrings, help topics, source)")
    p.add_argument("--out", "--output-prefix", "--output_prefix", dest="output_prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX_ids.npy + PREFIX_idx.npz (+ PREFIX_meta.json)")
    add_overwrite_arg(p, "the files of a finished PREFIX")
    p.add_argument("--tokenizer", metavar="SPEC",
                   help="gpt2 | a tokenizer directory or tokenizer.json | a model directory "
                        "(default: Data.tokenizer from -c/-o, else gpt2)")
    p.add_argument("--json-key", "--json_key", default="text", metavar="KEY", help="jsonl field holding the text")
    p.add_argument("--append-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="end every document with <|endoftext|> (default: on with --builtin, off otherwise, "
                        "as the reference's flag)")
    p.add_argument("--append_eos", dest="append_eos", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--min-doc-length", "--min_doc_length", type=int, default=10, metavar="N",
                   help="keep documents with more than N characters (default 10)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="tokenizer processes (default: every core; 1 below 4 MB of input)")
    p.add_argument("--strict", action="store_true", help="reject invalid UTF-8 instead of replacing it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_args(p, ckpt=False)


def run(args: argparse.Namespace) -> int:
    from gptforge.commands.common import refuse_existing
    from gptforge.data.preprocess import finished_marker, preprocess_documents, preprocess_files
    from gptforge.data.tokenizer import load_tokenizer

    if not args.input and not args.builtin:
        raise UsageError("give --input FILE/DIR/GLOB ... or --builtin")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers {args.workers}: must be >= 1")
    if args.min_doc_length < 0:
        raise UsageError(f"--min-doc-length {args.min_doc_length}: must be >= 0")
    refuse_existing([finished_marker(args.output_prefix)], args.force)  # before the tokenizer loads or a byte is read
    spec = args.tokenizer
    if spec is None and (args.config or args.override):
        from gptforge.commands.common import config_from_args

        spec = config_from_args(args).Data.tokenizer
    tok = load_tokenizer(spec)
    progress = not args.no_progress
    if args.builtin:
        from gptforge.data.corpus import builtin_documents

        append = True if args.append_eos is None else args.append_eos
        stats = preprocess_documents(builtin_documents(), args.output_prefix, tok, append_eos=append,
                                     min_doc_length=args.min_doc_length, workers=args.workers,
                                     progress=progress, source="builtin: Python standard library")
    else:
        stats = preprocess_files(args.input, args.output_prefix, tok, json_key=args.json_key,
                                 append_eos=bool(args.append_eos), min_doc_length=args.min_doc_length,
                                 workers=args.workers, strict=args.strict, progress=progress)
    p = stats.output_prefix
    print(f"wrote {p}_ids.npy + {p}_idx.npz: {stats.documents} documents, {stats.tokens} tokens "
          f"(tokenizer {tok.name}, vocab {tok.vocab_size}) from {stats.bytes_in / 1e6:.2f} MB in "
          f"{stats.seconds:.1f} s ({stats.mb_per_s:.2f} MB/s, {stats.workers} worker(s))")
    notes = []
    if stats.dropped:
        notes.append(f"{stats.dropped} document(s) of <= {args.min_doc_length} characters dropped")
    if stats.invalid_utf8_replaced:
        notes.append(f"{stats.invalid_utf8_replaced} invalid UTF-8 sequence(s) replaced by U+FFFD (--strict rejects them)")
    if notes:
        print("note: " + "; ".join(notes))
    return 0
