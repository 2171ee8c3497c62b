"""`gptforge serve`: an OpenAI-compatible HTTP server with continuous batching.

    gptforge serve --ckpt DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--device cpu]
    gptforge serve --ckpt ONNX_DIR --backend onnx
    gptforge serve --ckpt DIR -o Generation.draft=DRAFT_DIR [-o Generation.num_draft_tokens=K|auto]
    gptforge serve --ckpt BASE --adapter sql=SQL_DIR --adapter chat=CHAT_DIR   # LoRA adapters by name

Serves every model directory `generate` reads (ours, QAT, INT8, pruned, HF, .pdparams) with
the torch backend, and `gptforge export --format onnx` directories with onnxruntime (docs/serve.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gptforge.commands.common import add_config_args, add_sampling_args
from gptforge.errors import UsageError

EXTRA_HINT = "pip install 'gptforge[serve]'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p, ckpt_help="model directory (ours, QAT, INT8, pruned, HF GPT-2, .pdparams), or with "
                                 "--backend onnx a `gptforge export --format onnx` directory")
    p.add_argument("--backend", default="torch", choices=("torch", "onnx"), help="torch (default) or onnx (onnxruntime)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                   help="serve a LoRA/DoRA adapter directory (PEFT format) over --ckpt as model NAME (a bare DIR: "
                        "named after the directory); repeat for several, decoded together in one batch "
                        "(docs/serve.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--model-name", metavar="NAME", help="the model id clients send (default: the directory name)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every path but /health (default: "
                        "$GPTFORGE_API_KEY, else none; an empty key is refused)")
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, metavar="N",
                   help="larger request bodies get 413 (default 8388608 = 8 MiB)")
    p.add_argument("--request-timeout", type=float, metavar="S",
                   help="seconds a request may take from arrival, queueing included; past them it is "
                        "cancelled and answered 504 (default: no limit)")
    p.add_argument("--max-batch-size", type=int, default=16, metavar="N", help="sequences decoded together (default 16)")
    p.add_argument("--max-tokens-in-flight", type=int, metavar="N",
                   help="KV positions (prompt + max_tokens) reserved by running sequences at most "
                        "(default: max-batch-size x context length)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="sequences waiting for a slot before new requests get 429 (default 256)")
    p.add_argument("--prefill-tokens", type=int, default=512, metavar="N",
                   help="prompt tokens prefilled per step beside the running decodes, a multiple of 32; larger: new "
                        "requests get their first token sooner, running streams pause longer (default 512)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds to let running requests finish before aborting them (default 30)")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template (default: the plain-text one, docs/serve.md)")
    p.add_argument("--threads", type=int, metavar="N", help="onnx: onnxruntime intra-op threads")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    # The sampling flags (and their -o Generation.* keys) set what a request gets for a field it
    # omits; a request's own temperature, top_p, top_k, seed or max_tokens wins.
    add_sampling_args(p)


def check_serve_extra() -> None:
    """The `serve` extra is importable, or a one-line error naming the install command."""
    for name in ("fastapi", "uvicorn", "prometheus_client", "jinja2"):
        try:
            __import__(name)
        except ImportError:
            raise UsageError(f"gptforge serve needs the {name} package, which is not installed: {EXTRA_HINT}") from None


def _validate(args: argparse.Namespace) -> None:
    if not args.ckpt:
        raise UsageError("give the model to serve with --ckpt DIR")
    for flag, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-queue", args.max_queue, 1),
                             ("--port", args.port, 0), ("--prefill-tokens", args.prefill_tokens, 32)):
        if value < low:
            raise UsageError(f"{flag}: must be >= {low}, got {value}")
    if args.prefill_tokens % 32:
        raise UsageError(f"--prefill-tokens: must be a multiple of 32 (the prompt chunk), got {args.prefill_tokens}")
    if args.drain_timeout < 0:
        raise UsageError(f"--drain-timeout: must be >= 0, got {args.drain_timeout}")
    if args.max_body_bytes < 1024:
        raise UsageError(f"--max-body-bytes: must be >= 1024, got {args.max_body_bytes}")
    if args.request_timeout is not None and not 0 < args.request_timeout < float("inf"):
        raise UsageError(f"--request-timeout: must be a number of seconds > 0, got {args.request_timeout}")


def parse_adapters(values: list[str], base_name: str) -> list[tuple[str, str]]:
    """(name, directory) of each `--adapter NAME=DIR` (or bare DIR, named after it); names are
    unique and differ from the base's."""
    out: list[tuple[str, str]] = []
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or "/" in name or os.sep in name or Path(v).is_dir():
            name, path = Path(v).resolve().name, v
        if not path:
            raise UsageError(f"--adapter {v}: give NAME=DIR (the adapter directory after '=')")
        if name == base_name:
            raise UsageError(f"--adapter {v}: {name!r} is the base model's name; give the adapter another "
                             "(--adapter NAME=DIR) or the base one with --model-name")
        if name in (n for n, _ in out):
            raise UsageError(f"--adapter {v}: the name {name!r} is given twice; give each adapter its own name")
        out.append((name, path))
    return out


def api_key(args: argparse.Namespace) -> str | None:
    """`--api-key`, else $GPTFORGE_API_KEY, else None; set but empty is an error (an unset
    shell variable must not turn authentication off)."""
    if args.api_key is not None:
        source, key = "--api-key", args.api_key
    elif "GPTFORGE_API_KEY" in os.environ:
        source, key = "GPTFORGE_API_KEY", os.environ["GPTFORGE_API_KEY"]
    else:
        return None
    if not key.strip():
        raise UsageError(f"{source} is empty (an unset variable?); give the key clients must send, or leave "
                         f"{source} out to serve without one")
    return key


def load_served_model(args: argparse.Namespace):
    """(our model or an onnxruntime StepBackend, config, tokenizer) for `--ckpt` / `--backend`."""
    from gptforge.generate.loader import load_runnable

    if args.backend == "onnx":
        from gptforge.export.export_dir import load_export_config, read_export_dir

        path, _ = read_export_dir(args.ckpt, "onnx")
        return load_runnable(path, load_export_config(path, args.config, args.override), threads=args.threads)
    from gptforge.commands.common import config_from_args, select_device

    cfg = config_from_args(args)
    return load_runnable(args.ckpt, cfg, device=select_device(cfg.Global.device))


# Generation key -> the request field it is the server's default for.
_DEFAULT_OF = {"Generation.temperature": "temperature", "Generation.top_p": "top_p", "Generation.top_k": "top_k",
               "Generation.seed": "seed", "Generation.max_dec_len": "max_tokens"}


def sampling_defaults(args: argparse.Namespace, generation) -> dict:
    """The request fields the user set server defaults for (the sampling flags or `-o Generation.*`),
    with their resolved (range-checked) values; fields not set keep OpenAI's defaults."""
    given = {o.split("=", 1)[0].strip() for o in args.override if "=" in o}
    keys = {key: field for key, field in _DEFAULT_OF.items() if key in given}
    return {field: getattr(generation, key.split(".", 1)[1]) for key, field in keys.items()}


def load_served_draft(args: argparse.Namespace, model, cfg, tok):
    """The `Generation.draft` model for speculative decoding (None when unset), any kind the
    loader reads; its tokenizer must be the target's."""
    if not cfg.Generation.draft:
        return None
    from gptforge.generate.loader import load_draft
    from gptforge.generate.speculative import parse_num_draft_tokens

    parse_num_draft_tokens(cfg.Generation.num_draft_tokens)  # before loading anything
    device = model.wte.weight.device if hasattr(model, "wte") else None
    return load_draft(cfg.Generation.draft, tokenizer=tok, target_name=args.ckpt, device=device,
                      threads=args.threads)


def run(args: argparse.Namespace) -> int:
    _validate(args)
    key = api_key(args)
    check_serve_extra()
    from gptforge.serve.server import DrainingServer, ServeOptions, build_state

    name = args.model_name or Path(args.ckpt).resolve().name
    adapters = parse_adapters(args.adapter, name)
    if adapters and args.backend != "torch":
        raise UsageError(f"--adapter: adapters are served over our model directories (--backend torch), not over "
                         f"an {args.backend} export; merge one into the model before exporting instead")
    model, cfg, tok = load_served_model(args)
    if adapters:
        from gptforge.adapters.multi import serve_adapters

        serve_adapters(model, adapters)
    draft = load_served_draft(args, model, cfg, tok)
    opts = ServeOptions(model_name=name, host=args.host, port=args.port, api_key=key,
                        max_batch_size=args.max_batch_size, max_tokens_in_flight=args.max_tokens_in_flight,
                        max_queue=args.max_queue, prefill_tokens=args.prefill_tokens,
                        drain_timeout=args.drain_timeout, chat_template=args.chat_template,
                        public_metrics=args.public_metrics, max_body_bytes=args.max_body_bytes,
                        request_timeout=args.request_timeout,
                        sampling_defaults=sampling_defaults(args, cfg.Generation))
    state = build_state(model, tok, cfg.Generation, opts, draft=draft)

    def announce(port: int) -> None:  # once bound: the real port, also for --port 0
        host = f"[{args.host}]" if ":" in args.host else args.host
        served = f" + adapters {', '.join(n for n, _ in adapters)}" if adapters else ""
        print(f"gptforge serve: {name}{served} ({args.backend}) on http://{host}:{port}/v1", file=sys.stderr,
              flush=True)

    server = DrainingServer(state, opts, log_level=args.log_level, on_started=announce)
    server.run()
    return 0
