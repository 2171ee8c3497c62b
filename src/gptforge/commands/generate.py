"""`gptforge generate`: generate text from a model (sampling, greedy or beam search).

    gptforge generate --ckpt DIR --prompt "Hello" [--prompt "..."] [--max-new-tokens 50 --top-k 50]
    gptforge generate -c generation_gpt_345M_single_card --ckpt DIR --prompt-file F --json out.json
    gptforge generate --ckpt DIR [--adapter DIR] --chat --prompt "Hi" [--system TEXT] [--messages F.jsonl]

A single sequence is printed token by token as it is generated; several prompts are decoded in
left-padded batches and printed when done. `--json` also writes token ids and scores. With
`--chat` (or `--messages`) each prompt is a conversation rendered by the chat template that
`gptforge chat` and serve's /v1/chat/completions use, and only the answer is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gptforge.commands.common import (
    add_adapter_arg,
    add_chat_template_arg,
    add_config_args,
    add_overwrite_arg,
    add_sampling_args,
    config_from_args,
    ensure_out_file,
    require_ckpt,
    select_device,
)
from gptforge.errors import DataError, UsageError
from gptforge.fsguard import check_path_kind, disk_full_guard


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    add_adapter_arg(p)
    add_prompt_arguments(p)
    add_chat_arguments(p)
    add_sampling_args(p)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """`--chat`, `--messages`, `--system`, `--chat-template` (docs/generate.md#chat)."""
    g = p.add_argument_group("chat (the template of `gptforge chat` and serve's /v1/chat/completions)")
    g.add_argument("--chat", action="store_true", help="each --prompt (or --prompt-file line) is a user message: the "
                   "chat template renders it with its generation prompt, the answer ends at EOS or the template's "
                   "stop strings, and only the answer is printed")
    g.add_argument("--messages", metavar="FILE", help='JSON Lines (or a JSON array) of {"messages": [{"role": ..., '
                   '"content": ...}, ...]} conversations, each answered (implies --chat)')
    g.add_argument("--system", metavar="TEXT", help="with --chat: a system message opening each conversation that "
                   "has none")
    add_chat_template_arg(g)


def add_prompt_arguments(p: argparse.ArgumentParser) -> None:
    """The prompt and output options (shared with `gptforge infer`)."""
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompt-file", metavar="FILE", help="a UTF-8 text file with one prompt per line (blank lines "
                   "at its end are ignored; a blank line between prompts is an error)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print tokens as they are generated (default: on when one sequence is asked for)")
    p.add_argument("--out", "--json", dest="json", metavar="FILE", help=(
        "also write prompts, texts, token ids and scores to this JSON file (default: none; the text goes to stdout)"))
    add_overwrite_arg(p)
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="prompts decoded together (default 8)")
    p.add_argument("--truncate-prompt", action="store_true",
                   help="drop the beginning of prompts too long for the context window (default: error)")


def check_output(args: argparse.Namespace) -> None:
    """`--out FILE`: refused when it exists (unless --force) before prompts or a model are read."""
    if args.json:
        ensure_out_file(args.json, args.force)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """Prompts from --prompt and --prompt-file, in that order; empty ones are errors."""
    prompts = list(args.prompt)
    for i, p in enumerate(prompts):
        if not p:
            raise UsageError(f"--prompt number {i + 1} is empty; give some text")
    if args.prompt_file:
        path = check_path_kind(args.prompt_file, "file", "--prompt-file")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        while lines and not lines[-1].strip():  # an editor's final newline(s): not prompts
            lines.pop()
        if not lines:
            raise DataError(f"{path}: empty; give one prompt per line")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                raise DataError(f"{path}:{n}: empty prompt line; remove blank lines (one prompt per line)")
            prompts.append(line)
    if not prompts:
        raise UsageError("give a prompt with --prompt TEXT or --prompt-file FILE")
    return prompts


def read_chat(args: argparse.Namespace) -> list[tuple[str, list[dict]]] | None:
    """(where, messages) of each conversation of `--chat` (one user turn per prompt) and
    `--messages FILE`, with `--system` prepended where there is none; None without --chat."""
    from gptforge.data.instructions import read_conversations

    if not (args.chat or args.messages):
        for flag, value in (("--system", args.system), ("--chat-template", args.chat_template)):
            if value:
                raise UsageError(f"{flag} needs --chat (or --messages FILE): plain prompts use no chat template")
        return None
    convs = []
    if args.prompt or args.prompt_file:
        convs += [(f"prompt {i}", [{"role": "user", "content": p}]) for i, p in enumerate(read_prompts(args), 1)]
    if args.messages:
        convs += read_conversations(check_path_kind(args.messages, "file", "--messages"))
    if not convs:
        raise UsageError("--chat: give a user message with --prompt TEXT or --prompt-file FILE, or conversations "
                         "with --messages FILE")
    if args.system:
        convs = [(w, m if m[0]["role"] == "system" else [{"role": "system", "content": args.system}, *m])
                 for w, m in convs]
    return convs


def check_chat(args: argparse.Namespace, g) -> None:
    """What --chat cannot do, refused before the model loads."""
    if g.decode_strategy == "beam_search":
        raise UsageError("--chat: an answer ends at the chat template's stop strings, which beam search cannot apply; "
                         "use -o Generation.decode_strategy=greedy_search (or sampling)")
    if args.truncate_prompt:
        raise UsageError("--truncate-prompt would cut a conversation's first tokens (its system message); with --chat "
                         "shorten the conversation or lower --max-new-tokens")


def _write_json(path: str, payload: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with disk_full_guard(out), os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, ensure_ascii=False)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _payload(cfg, results, chat=None) -> dict:
    import dataclasses

    items = []
    for res in results:
        for i, prompt in enumerate(res.prompts):
            conv = {"messages": chat.conversations[len(items)]} if chat is not None else {}
            items.append({**conv, "prompt": prompt, "prompt_tokens": res.prompt_tokens[i], "completions": [
                {"text": t, "token_ids": ids, "score": s, "finish_reason": r}
                for t, ids, s, r in zip(res.texts[i], res.token_ids[i], res.scores[i], res.finish_reasons[i],
                                        strict=True)]})
    return {"generation": dataclasses.asdict(cfg.Generation), "results": items,
            "new_tokens": sum(r.new_tokens for r in results), "seconds": sum(r.seconds for r in results)}


def stream_mode(args: argparse.Namespace, g, prompts: list[str]) -> bool:
    """Whether to stream (`--stream` / the default), checked against the Generation settings."""
    one_sequence = g.decode_strategy != "beam_search" and g.num_return_sequences == 1
    if args.stream and not one_sequence:
        raise UsageError("--stream needs one sequence per prompt from greedy_search or sampling; "
                         "drop --stream (beam search and num_return_sequences > 1 print when done)")
    return args.stream if args.stream is not None else (one_sequence and len(prompts) == 1)


def run(args: argparse.Namespace) -> int:
    from gptforge.data.chat_template import template_for
    from gptforge.generate import check_config
    from gptforge.generate.api import chat_prompts
    from gptforge.generate.loader import load_draft, load_runnable

    require_ckpt(args)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size: must be >= 1, got {args.batch_size}")
    check_output(args)
    convs = read_chat(args)
    prompts = read_prompts(args) if convs is None else [w for w, _ in convs]
    cfg = config_from_args(args)
    check_config(cfg.Generation)
    if convs is not None:
        check_chat(args, cfg.Generation)
    # A bad --chat-template fails before the model loads.
    template = template_for(None, args.chat_template) if convs is not None and args.chat_template else None
    do_stream = stream_mode(args, cfg.Generation, prompts)
    device = select_device(cfg.Global.device)
    model, cfg, tok = load_runnable(args.ckpt, cfg, device=device, adapter=args.adapter)
    chat = None
    if convs is not None:  # the template the model was tuned with: --chat-template > adapter's > model's > default
        chat = ChatInput(template or template_for(tok, adapter=args.adapter), [m for _, m in convs])
        prompts = chat_prompts(chat.template, chat.conversations, [w for w, _ in convs])
    draft = (load_draft(cfg.Generation.draft, tokenizer=tok, target_name=args.ckpt, device=device)
             if cfg.Generation.draft else None)
    return emit(model, tok, prompts, cfg, args, do_stream, "generate", draft=draft, chat=chat)


@dataclass
class ChatInput:
    """`--chat`: the conversations and the template whose rendering of them are the prompts."""

    template: object  # data.chat_template.ChatTemplate
    conversations: list[list[dict]]


def emit(model, tok, prompts: list[str], cfg, args: argparse.Namespace, do_stream: bool, verb: str,
         draft=None, chat: ChatInput | None = None) -> int:
    """Generate with `model` (our GPT or a StepBackend) and print as `gptforge generate` does
    (shared with `gptforge infer`). With a draft, the speculative decoding figures (rounds,
    drafted and accepted tokens, acceptance rate) go to stderr and the JSON. With `chat`, the
    prompts are its conversations rendered: answers stop at the template's stop strings and are
    printed alone."""
    from gptforge.generate.spec_stats import collect_stats
    from gptforge.progress import info

    with collect_stats() as spec:
        results = _decode(model, tok, prompts, cfg, args, do_stream, draft, chat)
    new = sum(r.new_tokens for r in results)
    secs = sum(r.seconds for r in results)
    info(f"gptforge {verb}: {len(prompts)} prompt(s), {new} new tokens in {secs:.2f} s "
         f"({new / max(secs, 1e-9):.1f} tokens/s)")
    s = spec.stats if draft is not None else None
    if s is not None:
        info(f"gptforge {verb}: speculative decoding: acceptance rate {100 * s.acceptance_rate:.1f}% "
             f"({s.accepted} of {s.drafted} drafted tokens accepted in {s.rounds} rounds)")
    if args.json:
        payload = _payload(cfg, results, chat)
        payload["speculative"] = s.as_dict() if s is not None else None
        _write_json(args.json, payload)
        print(f"gptforge {verb}: wrote {args.json}", file=sys.stderr)
    return 0


def _decode(model, tok, prompts: list[str], cfg, args: argparse.Namespace, do_stream: bool, draft,
            chat: ChatInput | None = None) -> list:
    """Generate and print the texts (a chat's answers without their prompt or surrounding
    whitespace, as `gptforge chat` shows them); returns the `GenerationResult`s."""
    from gptforge.generate import generate, stream

    g = cfg.Generation
    stop = chat.template.stop if chat is not None else ()
    results = []
    if do_stream:
        for prompt in prompts:
            s = stream(model, tok, prompt, g, truncate_prompt=args.truncate_prompt, draft=draft, stop=stop,
                       scores=bool(args.json))  # streamed text shows no score: only --json reads it
            shown = chat is None
            sys.stdout.write(prompt if shown else "")
            sys.stdout.flush()
            for piece in s:
                piece = piece if shown else piece.lstrip()
                shown = shown or bool(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            results.append(s.result)
        return results
    res = generate(model, tok, prompts, g, truncate_prompt=args.truncate_prompt,
                   batch_size=args.batch_size, progress=len(prompts) > args.batch_size, draft=draft, stop=stop)
    many = len(prompts) > 1 or g.num_return_sequences > 1
    for i, prompt in enumerate(res.prompts):
        for j, text in enumerate(res.texts[i]):
            if many:
                print(f"### prompt {i + 1}/{len(prompts)}, sequence {j + 1}/{g.num_return_sequences}, "
                      f"score {res.scores[i][j]:.4f}, {res.finish_reasons[i][j]}")
            print(prompt + text if chat is None else text.strip())
    return [res]
