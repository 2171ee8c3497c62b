"""LAMBADA cloze accuracy (spec §7.1), with lm-eval's target perplexity alongside.

Each jsonl line `{"text": passage}` is split into context and target by one of two rules
(`Offline_Eval.lambada_split`):
- `reference` (default, the reference's and Megatron's --strict-lambada): the target is the
  last whitespace-separated word (`text.split()`) with a leading space, a whole word that may
  span several tokens; the context is the text before it, stripped. Context and target are
  encoded separately.
- `lm_eval`: lm-eval's `lambada_openai` exactly: `doc_to_text` = the words of
  `text.split(' ')` but the last, joined by ' '; `doc_to_target` = ' ' + the last of them; then
  `TemplateLM._encode_pair`: trailing whitespace of the context moves to the target, the target
  ids are those of `encode(context + target)` after `encode(context)`'s length.
The two differ only where the last space-separated piece is not the last word: a newline (or
a tab) before the last word (7 of the 5153 passages of the OpenAI test file), or trailing
whitespace. An example is correct iff every target token is the greedy argmax. Also reported, labelled: target perplexity (lm-eval's
`perplexity`: exp of minus the mean target log-likelihood over examples) and last-token
accuracy (the looser rule the GPT-2 paper appears to have used: only the last BPE token of the
word must be the argmax, its earlier pieces given).

Windows: a passage longer than the window keeps its rightmost tokens (as lm-eval does); a
target word longer than the window is an error. An empty context (a one-word passage) is
replaced by EOS, as lm-eval does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gptforge.errors import DataError
from gptforge.evaluate.common import (
    batch_sums,
    check_token_ids,
    check_window,
    model_context,
    read_text,
    reference_aggregate,
    score_sequences,
)


@dataclass
class LambadaExample:
    index: int  # 0-based position among the examples
    line: int  # 1-based line in the file
    context: str
    target: str  # " " + last word


SPLIT_RULES = ("reference", "lm_eval")


def split_passage(text: str, rule: str = "reference") -> tuple[str, str]:
    """(context, target) of a passage: by default the reference's strict rule (" " + the last
    whitespace-separated word); `rule="lm_eval"`: lambada_openai's doc_to_text / doc_to_target."""
    if rule == "lm_eval":
        words = text.split(" ")
        return " ".join(words[:-1]), " " + words[-1]
    if rule != "reference":
        raise ValueError(f"unknown LAMBADA split rule {rule!r}; one of {', '.join(SPLIT_RULES)}")
    last = text.split()[-1]
    return text[: text.rfind(last)].strip(), " " + last


def read_lambada(path: str | Path, rule: str = "reference") -> list[LambadaExample]:
    """Parse a LAMBADA-format jsonl, each passage split by `rule`; DataError naming file and
    line on anything malformed."""
    out: list[LambadaExample] = []
    for line_no, line in enumerate(read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg}); each line must be "
                            '{"text": "passage ..."}') from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise DataError(f'{path}:{line_no}: no "text" field; each line must be {{"text": "passage ..."}}')
        text = obj["text"]
        if not isinstance(text, str):
            raise DataError(f'{path}:{line_no}: "text" is a {type(text).__name__}, expected a string')
        if not text.split():
            raise DataError(f'{path}:{line_no}: "text" has no whitespace-separated word to predict')
        context, target = split_passage(text, rule)
        out.append(LambadaExample(len(out), line_no, context, target))
    if not out:
        raise DataError(f"{path}: no examples (only blank lines)")
    return out


def _encode_all(tokenizer, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [tokenizer.encode(t) for t in texts]


def encode_examples(tokenizer, examples: list[LambadaExample], rule: str = "reference"
                    ) -> tuple[list[list[int]], list[list[int]]]:
    """(context ids, target ids) per example. `reference`: each part encoded on its own.
    `lm_eval`: as lm-eval's `TemplateLM.loglikelihood` / `_encode_pair` (causal): an empty
    context becomes EOS later, as in both rules (the target starts with whitespace, so never
    with EOS, lm-eval's one exception); otherwise the context's trailing whitespace moves to the
    target and the target's ids are the tail of encode(context + target)."""
    if rule != "lm_eval":
        return (_encode_all(tokenizer, [e.context for e in examples]),
                _encode_all(tokenizer, [e.target for e in examples]))
    ctxs, tgts = [], []
    for e in examples:
        n = len(e.context) - len(e.context.rstrip())
        ctxs.append(e.context[:-n] if n else e.context)
        tgts.append(e.context[-n:] + e.target if n else e.target)
    ctx_ids = _encode_all(tokenizer, ctxs)
    whole = _encode_all(tokenizer, [c + t for c, t in zip(ctxs, tgts, strict=True)])
    tgt_ids = [w[len(c):] if e.context else _encode_all(tokenizer, [e.target])[0]
               for e, c, w in zip(examples, ctx_ids, whole, strict=True)]
    return [c if e.context else [] for e, c in zip(examples, ctx_ids, strict=True)], tgt_ids


def evaluate_lambada(model: torch.nn.Module, tokenizer, path: str | Path, batch_size: int = 8,
                     seq_len: int | None = None, *, vocab_size: int | None = None,
                     amp_dtype: torch.dtype | None = None, progress: bool = False,
                     logging_freq: int = 10, emulate_reference_aggregation: bool = False,
                     split_rule: str = "reference") -> dict:
    """LAMBADA metrics and per-example results for `model` on the jsonl at `path`.

    `seq_len` is the window (default and cap: the model's context); `vocab_size` limits the argmax and
    softmax to the first columns (default: all the model outputs, as the reference and HF do);
    `split_rule`: `reference` (default) or `lm_eval` (lambada_openai's rule, example by example).
    """
    examples = read_lambada(path, split_rule)
    # Passages are short: a window beyond the model's context is capped to it, not an error.
    L = check_window(model, min(seq_len or model_context(model), model_context(model)))
    ctx_ids, tgt_ids = encode_examples(tokenizer, examples, split_rule)
    eos = tokenizer.eos_token_id
    seqs, first, truncated = [], [], 0
    for e, c, t in zip(examples, ctx_ids, tgt_ids, strict=True):
        if not t:
            raise DataError(f"{path}:{e.line}: the target word {e.target.strip()!r} encodes to no tokens")
        if len(t) > L:
            raise DataError(f"{path}:{e.line}: the target word is {len(t)} tokens, longer than the "
                            f"window ({L}); raise Offline_Eval.max_seq_len or drop the line")
        full = (c or [eos]) + t
        if len(full) > L + 1:
            truncated += 1
            full = full[-(L + 1):]
        seqs.append(full)
        first.append(len(full) - 1 - len(t))
    check_token_ids(model, seqs, path)
    # Short passages share a forward pass up to the token budget of batch_size full windows.
    scored = score_sequences(model, seqs, first, batch_size=batch_size, max_tokens=batch_size * L, pad_id=eos,
                             vocab_size=vocab_size, amp_dtype=amp_dtype, progress=progress, desc="LAMBADA")
    n = len(examples)
    correct = sum(s.greedy for s in scored)
    last_correct = sum(s.last_greedy for s in scored)
    mean_lp = math.fsum(s.logprob for s in scored) / n
    acc = correct / n
    metrics = {
        "accuracy": acc,
        "number_correct": correct,
        "total_examples": n,
        "target_perplexity": math.exp(-mean_lp),
        "last_token_accuracy": last_correct / n,
        "target_tokens": sum(s.count for s in scored),
        "split_rule": split_rule,
        "truncated_contexts": truncated,
        "window": L,
    }
    result = {
        "task": "lambada",
        "path": str(path),
        "metrics": metrics,
        "metric_notes": {
            "accuracy": "strict whole-word: every token of ' '+last_word is the greedy argmax "
                        "(reference GPTEvalModule, Megatron --strict-lambada, lm-eval acc)",
            "split_rule": ("reference: last word = text.split()[-1] (the reference's rule)" if split_rule == "reference"
                           else "lm_eval: lambada_openai's doc_to_text/doc_to_target (text.split(' ')) and "
                                "_encode_pair"),
            "target_perplexity": "lm-eval style: exp(-mean over examples of the target log-likelihood)",
            "last_token_accuracy": "GPT-2 paper's looser rule: only the last BPE token of the word "
                                   "must be the argmax, its earlier pieces given",
        },
        "final_line": (f"validation results on {path} | number correct: {correct:.4E} | "
                       f"total examples: {n:.4E} | avg accuracy: {acc:.4E}"),
        "examples": [
            {"index": e.index, "line": e.line, "target": e.target, "correct": s.greedy, "target_logprob": s.logprob,
             "last_token_correct": s.last_greedy, "target_tokens": s.count}
            for e, s in zip(examples, scored, strict=True)
        ],
    }
    if emulate_reference_aggregation:
        ref = reference_aggregate(batch_sums([float(s.greedy) for s in scored], batch_size), logging_freq)
        result["reference_aggregation"] = {
            "number_correct": ref, "total_examples": n, "avg_accuracy": ref / n,
            "note": (f"EMULATED ppfleetx engine bug (spec 7.3): batch 0 counted x{logging_freq}, trailing "
                     f"partial group of batches dropped; batches of {batch_size} in file order. "
                     "Only for comparing with the reference's logs; not a correct accuracy."),
            "final_line": (f"validation results on {path} | number correct: {ref:.4E} | "
                           f"total examples: {n:.4E} | avg accuracy: {ref / n:.4E}"),
        }
    return result
