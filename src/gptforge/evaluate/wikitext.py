"""WikiText perplexity by the reference's (Megatron's) method (spec §7.2).

The whole file is detokenized and tokenized at once. Windows of `seq_len` + 1 tokens start
every `stride` tokens; the first window scores all its positions, each later window only its
last `stride`, so every token after the first is scored exactly once with at least
`seq_len - stride` tokens of context. avg_loss = Σ NLL / (N - 1); the adjusted perplexity
rescales the loss by tokens per original (whitespace-split) word, which makes numbers
comparable across tokenizers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from gptforge.errors import ConfigError, DataError
from gptforge.evaluate.common import (
    batch_sums,
    check_token_ids,
    check_window,
    read_text,
    reference_aggregate,
    score_sequences,
)

# Megatron's WikiText detokenizer, as an ordered table of (pattern, replacement, is_regex).
# Order matters: number separators before punctuation, "= = = =" before "= =".
_DETOK_RULES: list[tuple[str, str, bool]] = [
    ("s '", "s'", False),  # possessive plural
    (r"/' [0-9]/", r"/'[0-9]/", True),  # kept as Megatron has it: a literal pattern that rarely fires
    (" @-@ ", "-", False),  # number / compound separators
    (" @,@ ", ",", False),
    (" @.@ ", ".", False),
    (" : ", ": ", False),  # no space before punctuation
    (" ; ", "; ", False),
    (" . ", ". ", False),
    (" ! ", "! ", False),
    (" ? ", "? ", False),
    (" , ", ", ", False),
    (r"\(\s*([^\)]*?)\s*\)", r"(\1)", True),  # no spaces just inside brackets and quotes
    (r"\[\s*([^\]]*?)\s*\]", r"[\1]", True),
    (r"{\s*([^}]*?)\s*}", r"{\1}", True),
    (r"\"\s*([^\"]*?)\s*\"", r'"\1"', True),
    (r"'\s*([^']*?)\s*'", r"'\1'", True),
    ("= = = =", "====", False),  # headings
    ("= = =", "===", False),
    ("= =", "==", False),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}", False),
    (" \n", "\n", False),
    ("\n ", "\n", False),
    (" N ", " 1 ", False),
    (" 's", "'s", False),
]
_COMPILED = [(re.compile(p) if rx else p, r, rx) for p, r, rx in _DETOK_RULES]


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenization (` @-@ `, spaces before punctuation, `= = Heading = =`)."""
    for pat, rep, rx in _COMPILED:
        text = pat.sub(rep, text) if rx else text.replace(pat, rep)
    return text


def window_plan(n_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int]]:
    """(start token, first scored label) of every window the reference evaluates.

    The reference's window count, max(ceil(max(N-1-stride, 0) / stride) + 1, 1), includes
    trailing windows with nothing left to score when stride < seq_len; they are kept here so
    that emulated batch grouping matches, and skipped when scoring.
    """
    n_windows = max(math.ceil(max(n_tokens - 1 - stride, 0) / stride) + 1, 1)
    return [(i * stride, 0 if i == 0 else seq_len - stride) for i in range(n_windows)]


def evaluate_wikitext(model: torch.nn.Module, tokenizer, path: str | Path, seq_len: int | None,
                      stride: int | None = None, batch_size: int = 8, *, vocab_size: int | None = None,
                      amp_dtype: torch.dtype | None = None, progress: bool = False,
                      logging_freq: int = 10, emulate_reference_aggregation: bool = False,
                      detokenize: bool = True) -> dict:
    """Perplexity metrics for `model` on the WikiText-format file at `path`.

    `stride` is `Offline_Eval.overlapping_eval` (default: `seq_len`, i.e. disjoint windows).
    `detokenize=False` scores the file's text unchanged: the WikiText rules would rewrite other
    text (they drop a space after every newline, which changes the indentation of code).
    """
    raw = read_text(path)
    L = check_window(model, seq_len)
    s = L if stride is None else int(stride)
    if not 1 <= s <= L:
        raise ConfigError(f"Offline_Eval.overlapping_eval={stride}: must be between 1 and "
                          f"Offline_Eval.max_seq_len ({L})")
    num_original_tokens = len(raw.strip().split(" "))
    if num_original_tokens < 2:
        raise DataError(f"{path}: needs at least two words to measure perplexity")
    text = wikitext_detokenize(raw) if detokenize else raw
    tokens = tokenizer.encode(text)
    N = len(tokens)
    if N < 2:
        raise DataError(f"{path}: {N} token(s) after tokenization; nothing to score")
    check_token_ids(model, [tokens], path)
    plan = window_plan(N, L, s)
    seqs, first, used = [], [], []
    for w, (start, f) in enumerate(plan):
        win = tokens[start:start + L + 1]
        if len(win) - 1 > f:  # the window has labels left to score
            seqs.append(win)
            first.append(f)
            used.append(w)
    scored = score_sequences(model, seqs, first, batch_size=batch_size, pad_id=tokenizer.eos_token_id,
                             vocab_size=vocab_size, amp_dtype=amp_dtype, progress=progress, desc="WikiText")
    if sum(x.count for x in scored) != N - 1:  # every target exactly once, by construction
        raise AssertionError(f"scored {sum(x.count for x in scored)} targets, expected {N - 1}")
    nll = [0.0] * len(plan)
    for w, x in zip(used, scored, strict=True):
        nll[w] = -x.logprob
    metrics = _ppl_metrics(math.fsum(nll), N, num_original_tokens)
    metrics.update(windows=len(used), reference_windows=len(plan))
    metrics.update(_bits_per_byte(math.fsum(nll), text, tokenizer.decode(tokens[:1])))
    m = metrics
    result = {
        "task": "wikitext",
        "path": str(path),
        "metrics": m,
        "metric_notes": {
            "avg_loss": "sum of token NLL / (N - 1), N = tokens of the " + ("detokenized text" if detokenize else "file's text"),
            "ppl": "exp(min(20, avg_loss))",
            "token_ratio": "(N - 1) / (original whitespace-split words - 1)",
            "adjusted_ppl": "exp(min(20, avg_loss * token_ratio)): word-level-normalised perplexity",
            "bits_per_byte": "sum of token NLL / ln 2 / UTF-8 bytes of the scored text (the "
                             + ("detokenized" if detokenize else "file's") + " text after its first token): "
                             "tokenizer-independent",
        },
        "final_line": _final_line(path, m),
        "windows": [{"index": w, "start": plan[w][0], "scored": x.count, "nll": -x.logprob}
                    for w, x in zip(used, scored, strict=True)],
    }
    if emulate_reference_aggregation:
        ref = _ppl_metrics(reference_aggregate(batch_sums(nll, batch_size), logging_freq), N, num_original_tokens)
        result["reference_aggregation"] = {
            **ref,
            "note": (f"EMULATED ppfleetx engine bug (spec 7.3): batch 0 counted x{logging_freq}, trailing "
                     f"partial group of batches dropped; batches of {batch_size} windows in order. "
                     "Only for comparing with the reference's logs; not a correct perplexity."),
            "final_line": _final_line(path, ref),
        }
    return result


def _ppl_metrics(total_nll: float, n_tokens: int, num_original_tokens: int) -> dict:
    avg = total_nll / (n_tokens - 1)
    ratio = (n_tokens - 1) / (num_original_tokens - 1)
    return {
        "avg_loss": avg,
        "ppl": math.exp(min(20.0, avg)),
        "adjusted_ppl": math.exp(min(20.0, avg * ratio)),
        "token_ratio": ratio,
        "total_nll": total_nll,
        "num_tokens": n_tokens,
        "num_original_tokens": num_original_tokens,
    }


def _bits_per_byte(total_nll: float, text: str, first_token_text: str) -> dict:
    # The first token is context only (never scored), so its bytes are not counted either.
    scored = len(text.encode("utf-8")) - len(first_token_text.encode("utf-8"))
    return {"bits_per_byte": total_nll / math.log(2) / max(scored, 1), "scored_bytes": scored}


def _final_line(path, m: dict) -> str:
    return (f"validation results on {path} | avg loss: {m['avg_loss']:.4E} | ppl: {m['ppl']:.4E} | "
            f"adjusted ppl: {m['adjusted_ppl']:.4E} | token ratio: {m['token_ratio']} |")
