"""`gptforge chat`: talk with a model, turn by turn, answers streamed (docs/chat.md).

    gptforge chat --ckpt DIR [--adapter DIR] [--chat-template FILE] [--system TEXT] [--max-new-tokens N]
    echo "Hello" | gptforge chat --ckpt DIR -o Generation.decode_strategy=greedy_search

The prompt is the model's own chat template (the one `sft` saved with the model or adapter,
else gptforge's default), the same one serve's /v1/chat/completions uses.
"""

from __future__ import annotations

import argparse

from gptforge.commands.common import (
    add_adapter_arg,
    add_chat_template_arg,
    add_config_args,
    add_sampling_args,
    config_from_args,
    require_ckpt,
    select_device,
)

# The answer limit when neither --max-new-tokens nor -o Generation.max_dec_len is given
# (Generation.max_dec_len's own default, 20, cuts most answers short); at most half the context.
DEFAULT_MAX_NEW_TOKENS = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    add_adapter_arg(p)
    add_chat_template_arg(p)
    p.add_argument("--system", metavar="TEXT", help="a system message that opens the conversation (kept when old "
                   "turns are dropped to fit the context)")
    p.add_argument("--verbose", action="store_true",
                   help="after each answer, print its prompt and answer token counts and speed on stderr")
    add_sampling_args(p)


def max_new_tokens(args: argparse.Namespace, generation, max_positions: int) -> int:
    """The answer limit: --max-new-tokens / -o Generation.max_dec_len when given, else
    DEFAULT_MAX_NEW_TOKENS capped at half the model's positions."""
    given = any(o.split("=", 1)[0].strip() == "Generation.max_dec_len" for o in args.override)
    return generation.max_dec_len if given else min(DEFAULT_MAX_NEW_TOKENS, max_positions // 2)


def run(args: argparse.Namespace) -> int:
    from gptforge.chat import ChatSession, run_repl
    from gptforge.chat.session import chat_generation, check_chat_generation
    from gptforge.data.chat_template import template_for
    from gptforge.generate import check_config
    from gptforge.generate.backend import as_backend
    from gptforge.generate.loader import load_draft, load_runnable
    from gptforge.progress import info

    require_ckpt(args)
    cfg = config_from_args(args)
    check_config(cfg.Generation)
    check_chat_generation(cfg.Generation)
    # A bad --chat-template fails before the model loads.
    template = template_for(None, args.chat_template) if args.chat_template else None
    device = select_device(cfg.Global.device)
    model, cfg, tok = load_runnable(args.ckpt, cfg, device=device, adapter=args.adapter)
    template = template or template_for(tok, adapter=args.adapter)
    draft = (load_draft(cfg.Generation.draft, tokenizer=tok, target_name=args.ckpt, device=device)
             if cfg.Generation.draft else None)
    g = cfg.Generation
    with as_backend(model, prepack=g.fast_cpu_decode, use_cache=g.use_cache) as backend:
        g = chat_generation(g, max_new_tokens(args, g, backend.max_positions))
        session = ChatSession(backend, tok, template, g, system=args.system, draft=draft)
        info(f"gptforge chat: {args.ckpt}{f' + {args.adapter}' if args.adapter else ''}, {template.origin}; "
             "/reset clears the history, /exit leaves, Ctrl-C stops an answer")
        return run_repl(session, verbose=args.verbose)
