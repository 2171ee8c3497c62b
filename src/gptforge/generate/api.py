"""The generation API: check the config, tokenize and left-pad prompts, run a decode loop,
decode the text; `stream` yields text as it is produced.

    from gptforge.generate import generate, stream
    res = generate(model, tokenizer, ["Hello", "The cat"], cfg.Generation)
    res.texts[0][0], res.scores[0][0]
    for piece in stream(model, tokenizer, "Once upon a time", cfg.Generation):
        print(piece, end="", flush=True)

`model` is our `GPT` (any device/dtype) or any `StepBackend` (see `backend.py`), so the same
code drives an ONNX Runtime model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from gptforge.config.sampling import check_kv_cache_dtype, check_sampling
from gptforge.config.schema import GenerationConfig
from gptforge.data.chat_template import ChatTemplate, check_messages, template_for
from gptforge.errors import ConfigError, DataError
from gptforge.generate.backend import as_backend
from gptforge.generate.beam import beam_search
from gptforge.generate.engine.offline import offline_engine, run_requests
from gptforge.generate.engine.output import IncrementalDecoder
from gptforge.generate.engine.params import from_generation
from gptforge.generate.engine.sequence import Request
from gptforge.generate.engine.spec import SpecStats
from gptforge.generate.loader import load_draft
from gptforge.generate.memory import check_decode_fits
from gptforge.generate.processors import LogitsProcessor, build_processors
from gptforge.generate.search import SearchOutput, left_pad
from gptforge.generate.speculative import check_speculative

__all__ = ["GenerationResult", "IncrementalDecoder", "TextStream", "chat_prompts", "check_config", "fit_prompts",
           "generate", "generate_chat", "generate_ids", "special_ids", "stream"]

STRATEGIES = ("sampling", "greedy_search", "beam_search")


def check_config(cfg: GenerationConfig) -> None:
    """Raise `ConfigError` (naming the key, the value and the fix) for settings that cannot run."""
    def bad(key: str, msg: str) -> ConfigError:
        return ConfigError(f"Generation.{key}: {msg}")

    s = cfg.decode_strategy
    if s not in STRATEGIES:
        near = [x for x in STRATEGIES if x.startswith(str(s).lower()[:4])] or difflib.get_close_matches(
            str(s), STRATEGIES, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise bad("decode_strategy", f"{s!r} is not one of {', '.join(STRATEGIES)}{hint}")
    if cfg.max_dec_len < 1:
        raise bad("max_dec_len", f"must be >= 1, got {cfg.max_dec_len}")
    if cfg.min_dec_len < 0:
        raise bad("min_dec_len", f"must be >= 0, got {cfg.min_dec_len}")
    if s == "sampling" and cfg.temperature == 0:
        raise bad("temperature", f"must be > 0 with sampling, got {cfg.temperature}; "
                  "use decode_strategy=greedy_search for deterministic output")
    check_sampling(cfg)  # the ranges every sampling parameter must keep (config.sampling)
    check_kv_cache_dtype(cfg)
    if cfg.num_return_sequences < 1:
        raise bad("num_return_sequences", f"must be >= 1, got {cfg.num_return_sequences}")
    if cfg.num_beams < 1:
        raise bad("num_beams", f"must be >= 1, got {cfg.num_beams}")
    if s == "beam_search":
        if cfg.num_beams < cfg.num_return_sequences:
            raise bad("num_beams", f"{cfg.num_beams} < num_return_sequences {cfg.num_return_sequences}: "
                      "beam search returns at most num_beams hypotheses; raise num_beams")
        if cfg.num_beam_groups > 1 or cfg.diversity_rate != 0.0:
            raise bad("num_beam_groups", "diverse (group) beam search is not supported; "
                      "set num_beam_groups=1 and diversity_rate=0")
    else:
        if cfg.num_beams > 1:
            raise bad("num_beams", f"{cfg.num_beams} needs decode_strategy=beam_search (it is {s!r})")
        if s == "greedy_search" and cfg.num_return_sequences > 1:
            raise bad("num_return_sequences", f"{cfg.num_return_sequences} with greedy_search would repeat "
                      "one sequence; use sampling or beam_search")
    if cfg.draft:
        check_speculative(cfg)


def special_ids(cfg: GenerationConfig, tokenizer_eos: int | None) -> tuple[list[int], int]:
    """(EOS ids, pad id): the config's values, else the tokenizer's EOS for both."""
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer_eos
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos if eos is not None else 0)
    return ([int(eos)] if eos is not None else []), int(pad)


def fit_prompts(prompts: Sequence[Sequence[int]], max_new: int, max_positions: int, vocab_size: int,
                truncate: bool = False) -> list[list[int]]:
    """Check prompt ids against the context window (prompt + max_dec_len <= max positions) and
    the vocabulary; with `truncate` keep the right end of prompts that are too long."""
    room = max_positions - max_new
    if room < 1:
        raise ConfigError(f"Generation.max_dec_len: {max_new} leaves no room for a prompt in the model's "
                          f"{max_positions} positions; lower it")
    out = []
    for i, p in enumerate(prompts):
        p = [int(t) for t in p]
        if not p:
            raise DataError(f"prompt {i + 1} is empty (0 tokens); give some text")
        if len(p) > room:
            if not truncate:
                raise DataError(
                    f"prompt {i + 1} has {len(p)} tokens but the model has {max_positions} positions and "
                    f"Generation.max_dec_len={max_new} leaves room for {room}; shorten the prompt, lower "
                    "max_dec_len, or drop its beginning with --truncate-prompt (truncate_prompt=True)")
            p = p[-room:]
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise DataError(f"prompt {i + 1}: token id {bad[0]} is outside the model's vocabulary of {vocab_size}; "
                            "the tokenizer does not belong to this model")
        out.append(p)
    return out


def _decode(be, dbe, ids: list[list[int]], cfg: GenerationConfig, eos: list[int], pad: int,
            vocab_limit: int | None, extra: Sequence[LogitsProcessor], batch_size: int | None = None,
            on_finish=None, stop: Sequence[str] = (), tokenizer=None) -> SearchOutput:
    """Decode token-id prompts: beam search in batches of `batch_size`, else the engine
    (continuous batching of up to `batch_size` prompts' sequences at once; default all).
    `stop` strings (with the `tokenizer` that spells the text) end a sequence's text before them."""
    if cfg.decode_strategy == "beam_search":
        if stop:
            raise ConfigError("Generation.decode_strategy: stop strings (a chat template's) need greedy_search or "
                              "sampling; beam search ranks whole hypotheses and cannot end one at a string")
        bs = batch_size or len(ids)
        outs = []
        for start in range(0, len(ids), bs):
            batch = left_pad(ids[start:start + bs], pad, be.device)
            procs = build_processors(cfg.repetition_penalty, cfg.min_dec_len, batch.length, eos, vocab_limit, extra)
            outs.append(beam_search(be, batch, num_beams=cfg.num_beams, max_new_tokens=cfg.max_dec_len,
                                    processors=procs, eos_token_ids=eos, pad_token_id=pad,
                                    length_penalty=cfg.length_penalty, early_stopping=cfg.early_stopping,
                                    num_return_sequences=cfg.num_return_sequences))
            if on_finish is not None:
                for _ in range(len(outs[-1].lengths)):
                    on_finish(None)
        return SearchOutput.concat(outs, pad)
    params = dataclasses.replace(from_generation(cfg), stop=list(stop))
    core = offline_engine(be, eos_token_ids=eos, vocab_limit=vocab_limit,
                          max_batch_size=(batch_size or len(ids)) * params.n, processors=extra,
                          tokenizer=tokenizer if stop else None, draft_backend=dbe,
                          num_draft_tokens=cfg.num_draft_tokens)
    seqs = run_requests(core, ids, params, on_finish)
    width = cfg.max_dec_len if not cfg.early_finish else None
    out = SearchOutput.from_sequences(seqs, eos, pad, width, core.stats)
    if stop:  # the engine's own text, cut where a stop string began (the tokens that spelled it stay counted)
        out.texts = [s.text_state.text for s in seqs]
        out.stopped = [s.finish_reason == "stop" and not bool(f) for s, f in zip(seqs, out.finished, strict=True)]
    return out


def _resolve_draft(cfg: GenerationConfig, draft, tokenizer=None, device=None):
    """The draft to use: the one given, else `Generation.draft` loaded (tokenizer checked), else None."""
    if draft is not None or not cfg.draft:
        return draft
    return load_draft(cfg.draft, device=device, tokenizer=tokenizer)


@contextlib.contextmanager
def _backends(model, draft, cfg: GenerationConfig):
    """(target backend, draft backend or None), open for the duration."""
    if draft is not None:
        check_speculative(cfg)
    kv = cfg.kv_cache_dtype
    with as_backend(model, prepack=cfg.fast_cpu_decode, use_cache=cfg.use_cache, kv_cache_dtype=kv) as be:
        if draft is None:
            yield be, None
            return
        with as_backend(draft, prepack=cfg.fast_cpu_decode, kv_cache_dtype=kv) as dbe:
            yield be, dbe


def _device_of(model):
    return model.wte.weight.device if isinstance(model, torch.nn.Module) else getattr(model, "device", None)


def generate_ids(model, prompt_ids: Sequence[Sequence[int]], config: GenerationConfig | None = None, *,
                 eos_token_id: int | None = None, vocab_limit: int | None = None,
                 processors: Sequence[LogitsProcessor] = (), truncate_prompt: bool = False,
                 draft=None, batch_size: int | None = None) -> SearchOutput:
    """Generate from token-id prompts. `model`: our GPT or a `StepBackend`. `eos_token_id` is
    the default for `Generation.eos_token_id`/`pad_token_id`; ids >= `vocab_limit` are never
    generated. `draft` (a model or `StepBackend`; default: `Generation.draft` loaded) turns on
    speculative decoding. Returns `SearchOutput` rows ordered prompt-major (`num_return_sequences`
    each); with a draft, `.speculative` holds its `SpecStats`."""
    cfg = config or GenerationConfig()
    check_config(cfg)
    eos, pad = special_ids(cfg, eos_token_id)
    draft = _resolve_draft(cfg, draft, device=_device_of(model))
    with _backends(model, draft, cfg) as (be, dbe):
        ids = fit_prompts(prompt_ids, cfg.max_dec_len, be.max_positions, be.vocab_size, truncate_prompt)
        check_decode_fits(be, cfg, min(batch_size or len(ids), len(ids)), max(map(len, ids), default=1),
                          vocab_limit)
        return _decode(be, dbe, ids, cfg, eos, pad, vocab_limit, processors, batch_size)


@dataclass
class GenerationResult:
    """Per prompt, `num_return_sequences` continuations (the prompt itself is not repeated)."""

    prompts: list[str]
    texts: list[list[str]]
    token_ids: list[list[list[int]]]  # generated ids, without the final EOS
    scores: list[list[float]]  # mean log-prob per token (greedy/sampling) or the beam score
    finish_reasons: list[list[str]]  # "eos" | "length" | "stop" (a stop string)
    seconds: float = 0.0
    new_tokens: int = 0  # tokens generated in total (EOS included)
    prompt_tokens: list[int] = field(default_factory=list)
    speculative: SpecStats | None = None  # with a draft: rounds, drafted, accepted, acceptance_rate


def _prepare(model, tokenizer, prompts, config, device, truncate):
    cfg = config or GenerationConfig()
    check_config(cfg)
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts:
        raise DataError("no prompts given")
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t:
            raise DataError(f"prompt {i + 1} is empty; give some text")
    if device is not None and isinstance(model, torch.nn.Module):
        model.to(device)
    eos, pad = special_ids(cfg, tokenizer.eos_token_id)
    vocab = getattr(model, "vocab_size", None) or model.wte.weight.shape[0]
    limit = tokenizer.vocab_size if tokenizer.vocab_size < vocab else None
    max_pos = model.config.max_position_embeddings if isinstance(model, torch.nn.Module) else model.max_positions
    ids = fit_prompts(tokenizer.encode_batch(texts), cfg.max_dec_len, max_pos, vocab, truncate)
    return cfg, texts, ids, eos, pad, limit


def generate(model, tokenizer, prompts: str | Sequence[str], config: GenerationConfig | None = None,
             device=None, *, processors: Sequence[LogitsProcessor] = (), truncate_prompt: bool = False,
             batch_size: int | None = None, progress: bool = False, draft=None,
             stop: Sequence[str] = ()) -> GenerationResult:
    """Generate continuations of text prompts. Greedy and sampling run the engine: continuous
    batching of up to `batch_size` prompts at once (default: all), to completion; beam search
    runs left-padded batches of `batch_size`. `device` moves the model there first; `progress`
    shows a bar on stderr. `draft` (a model or `StepBackend` with the same tokenizer; default:
    `Generation.draft` loaded) turns on speculative decoding. `stop`: strings that end a text
    before them (greedy and sampling; finish reason "stop"), as in `stream`."""
    cfg, texts, ids, eos, pad, limit = _prepare(model, tokenizer, prompts, config, device, truncate_prompt)
    draft = _resolve_draft(cfg, draft, tokenizer, _device_of(model))
    res = GenerationResult(texts, [], [], [], [], prompt_tokens=[len(p) for p in ids])
    n = cfg.num_return_sequences
    t0 = time.perf_counter()
    bar = None
    if progress:
        from gptforge.progress import bar as progress_bar

        bar = progress_bar(total=len(ids) * n, desc="generate", unit="seq")
    with _backends(model, draft, cfg) as (be, dbe):
        check_decode_fits(be, cfg, min(batch_size or len(ids), len(ids)), max(map(len, ids), default=1), limit)
        out = _decode(be, dbe, ids, cfg, eos, pad, limit, processors, batch_size,
                      on_finish=(lambda _ev: bar.update(1)) if bar is not None else None, stop=stop,
                      tokenizer=tokenizer)
    if bar is not None:
        bar.close()
    seqs = out.sequences()
    res.new_tokens = int(out.lengths.sum())
    res.speculative = out.speculative
    for i in range(len(ids)):
        rows = range(i * n, (i + 1) * n)
        res.token_ids.append([seqs[r] for r in rows])
        res.texts.append([out.texts[r] if out.texts is not None else tokenizer.decode(seqs[r]) for r in rows])
        res.scores.append([float(out.scores[r]) for r in rows])
        res.finish_reasons.append(["eos" if out.finished[r] else "stop" if out.stopped and out.stopped[r]
                                   else "length" for r in rows])
    res.seconds = time.perf_counter() - t0
    return res


def chat_prompts(template: ChatTemplate, conversations: Sequence[Sequence[dict]],
                 where: Sequence[str] | None = None) -> list[str]:
    """The text a model continues for each conversation: its messages and the generation
    prompt, as `gptforge chat` and serve's /v1/chat/completions render them. A bad message or
    a template that refuses a conversation is a DataError naming `where[i]` (default
    "conversation i")."""
    out = []
    for i, conv in enumerate(conversations):
        at = where[i] if where is not None else f"conversation {i + 1}"
        msgs = check_messages(list(conv) if isinstance(conv, (list, tuple)) else conv, at)
        try:
            out.append(template.prompt(msgs))
        except DataError as e:
            raise DataError(f"{at}: {e}") from None
    return out


def generate_chat(model, tokenizer, conversations: Sequence[dict] | Sequence[Sequence[dict]],
                  config: GenerationConfig | None = None, *, template: ChatTemplate | None = None,
                  **kwargs) -> GenerationResult:
    """Answer conversations (each a list of {role, content} messages; one conversation may be
    given alone): rendered by `template` (default: the tokenizer's own chat template, else
    gptforge's default) with the generation prompt, each answer ending at EOS or the
    template's stop strings. `kwargs` as in `generate` (greedy or sampling)."""
    convs = list(conversations)
    if convs and isinstance(convs[0], dict):
        convs = [convs]
    if not convs:
        raise DataError("no conversations given")
    template = template or template_for(tokenizer)
    return generate(model, tokenizer, chat_prompts(template, convs), config, stop=template.stop, **kwargs)


# ------------------------------------------------------------------------------ streaming

class TextStream:
    """Iterate to receive text deltas (complete characters only) of one continuation as it is
    generated; after the loop `result` holds the `GenerationResult`."""

    def __init__(self, model, tokenizer, prompt: str, cfg, ids, eos, pad, limit, processors, draft=None,
                 stop: Sequence[str] = (), scores: bool = True):
        self._args = (model, tokenizer, prompt, cfg, ids, eos, pad, limit, processors)
        self._scores = scores
        self._draft = draft
        self._stop = list(stop)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        model, tokenizer, prompt, cfg, ids, eos, pad, limit, processors = self._args
        t0 = time.perf_counter()
        with _backends(model, self._draft, cfg) as (be, dbe):
            core = offline_engine(be, eos_token_ids=eos, vocab_limit=limit, max_batch_size=1, processors=processors,
                                  tokenizer=tokenizer, draft_backend=dbe, num_draft_tokens=cfg.num_draft_tokens)
            events: list = []
            params = dataclasses.replace(from_generation(cfg), stop=self._stop)
            seq = core.add(Request([ids[0]], params, n=1, sink=events.append, keep_scores=self._scores),
                           bounded=False)[0]
            pieces: list[str] = []
            while core.has_work:
                with torch.inference_mode():
                    core.step()
                for ev in events:
                    if ev.text:
                        pieces.append(ev.text)
                        yield ev.text
                events.clear()
        toks = list(seq.generated)
        ended = bool(toks) and toks[-1] in eos
        kept = toks[:-1] if ended else toks
        # A stop string ends the text before it (the tokens that spelled it are still counted).
        reason = "eos" if ended else "stop" if seq.finish_reason == "stop" else "length"
        text = "".join(pieces) if reason == "stop" else tokenizer.decode(kept)
        self.result = GenerationResult(
            [prompt], [[text]], [[kept]], [[seq.logprob_sum / max(len(toks), 1) if self._scores else float("nan")]],
            [[reason]], time.perf_counter() - t0, len(toks), [len(ids[0])], core.stats)


def stream(model, tokenizer, prompt: str, config: GenerationConfig | None = None, device=None, *,
           processors: Sequence[LogitsProcessor] = (), truncate_prompt: bool = False, draft=None,
           stop: Sequence[str] = (), scores: bool = True) -> TextStream:
    """Text deltas of one continuation as they are generated (greedy or sampling, one sequence).
    The config and prompt are checked now; generation runs while you iterate. `draft`: as in
    `generate`. `stop`: strings that end the text before them (a chat template's, e.g.
    "\\nUser:"); its finish reason is then "stop". Closing the iterator early stops decoding.
    `scores=False`: the result's score is NaN, and greedy decoding may then screen the LM head
    (only the argmax is read: the same tokens, faster; docs/generate.md)."""
    cfg, texts, ids, eos, pad, limit = _prepare(model, tokenizer, prompt, config, device, truncate_prompt)
    if len(texts) != 1:
        raise DataError(f"stream takes one prompt, got {len(texts)}; use generate() for a batch")
    if cfg.decode_strategy == "beam_search" or cfg.num_return_sequences != 1:
        raise ConfigError("Generation.decode_strategy: streaming needs one sequence from greedy_search or "
                          "sampling (beam search only knows its best sequence at the end); use generate()")
    draft = _resolve_draft(cfg, draft, tokenizer, _device_of(model))
    return TextStream(model, tokenizer, texts[0], dataclasses.replace(cfg), ids, eos, pad, limit, processors, draft,
                      stop, scores)
