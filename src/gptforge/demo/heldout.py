"""Evaluation files for the demo, cut from documents the model never trains on.

The corpus's document split (`Data.*.dataset.split`, e.g. [949, 50, 1]) assigns a contiguous
range of documents to Eval; training reads only the Train range. From the Eval documents,
decoded back to text from the token files (byte-level BPE round-trips exactly), we write:

- `heldout.txt`: documents joined by blank lines up to `max_chars`, scored by `gptforge eval`
  with the WikiText method (`cloze_eval: False`);
- `cloze.jsonl`: LAMBADA-format passages (`{"text": ...}`) whose last word is the target.
  As in LAMBADA, targets are chosen to be guessable from the passage: a plain alphabetic word
  of at least 4 letters that already occurred in the passage's context. The passage starts at a
  line boundary `context_words` words or more before the target, so a reader sees a real
  stretch of text, and ends right after the target word.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptforge.errors import DataError

_WORD = re.compile(r"\S+")
_TARGET = re.compile(r"[A-Za-z]{4,}")


@dataclass
class HeldoutFiles:
    text: Path
    cloze: Path
    documents: int  # Eval documents available
    text_chars: int
    cloze_examples: int


def eval_documents(prefix: str | Path, tokenizer, split) -> list[str]:
    """The text of the Eval-range documents of the token files at `prefix`."""
    return split_documents(prefix, tokenizer, split, 1)


def split_documents(prefix: str | Path, tokenizer, split, part: int, first: float = 0.0,
                    chars: int | None = None) -> list[str]:
    """The text of the documents of one part of `split` (0 Train, 1 Eval, 2 Test) of the token
    files at `prefix`, from the fraction `first` of that range on, until `chars` characters."""
    from gptforge.data.index_map import split_boundaries
    from gptforge.data.indexed import load_token_files

    tf = load_token_files(prefix)
    bounds = split_boundaries(split, tf.n_docs)
    starts = np.concatenate([[0], np.cumsum(tf.lens, dtype=np.int64)])
    docs = []
    eos = tokenizer.eos_token_id
    lo, hi = bounds[part], bounds[part + 1]
    total = 0
    for d in range(lo + int(first * (hi - lo)), hi):
        if chars is not None and total >= chars:
            break
        ids = [int(t) for t in tf.ids[starts[d]:starts[d + 1]] if int(t) != eos]
        text = tokenizer.decode(ids).strip()
        if text:
            docs.append(text)
            total += len(text)
    if not docs:
        name = ("Train", "Eval", "Test")[part]
        raise DataError(f"{prefix}: the {name} part of split {split} holds no documents; give it a larger weight")
    return docs


def cloze_passages(docs: list[str], n: int, context_words: int = 40, per_doc: int = 3) -> list[str]:
    """Up to `n` LAMBADA-style passages (see the module docstring), spread over the documents."""
    out: list[str] = []
    for doc in docs:
        words = list(_WORD.finditer(doc))
        taken, last_end = 0, -1
        for i in range(context_words, len(words)):
            w = words[i].group()
            if not _TARGET.fullmatch(w) or i <= last_end + context_words:
                continue
            if w not in {x.group() for x in words[i - context_words:i]}:
                continue
            # start the passage at the beginning of the line holding word i - context_words
            start = doc.rfind("\n", 0, words[i - context_words].start()) + 1
            passage = doc[start:words[i].end()].strip()
            if len(passage.split()) < context_words // 2:
                continue
            out.append(passage)
            taken, last_end = taken + 1, i
            if taken >= per_doc or len(out) >= n:
                break
        if len(out) >= n:
            break
    return out


def write_heldout(prefix: str | Path, tokenizer, split, out_dir: str | Path, *, max_chars: int,
                  cloze_examples: int) -> HeldoutFiles:
    """Write `heldout.txt` and `cloze.jsonl` under `out_dir` from the Eval documents."""
    docs = eval_documents(prefix, tokenizer, split)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts, size = [], 0
    for d in docs:
        if size >= max_chars:
            break
        parts.append(d)
        size += len(d) + 2
    text = "\n\n".join(parts)[:max_chars]
    text_path = out / "heldout.txt"
    text_path.write_text(text + "\n", encoding="utf-8")
    passages = cloze_passages(docs, cloze_examples)
    if not passages:
        raise DataError(f"{prefix}: no cloze passage could be cut from {len(docs)} Eval documents")
    cloze_path = out / "cloze.jsonl"
    cloze_path.write_text("".join(json.dumps({"text": p}) + "\n" for p in passages), encoding="utf-8")
    return HeldoutFiles(text_path, cloze_path, len(docs), len(text), len(passages))


def xz_bits_per_byte(data: bytes) -> float:
    """What `xz -9e` needs per byte of `data`: the bar a model of the text must beat."""
    import lzma

    return len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) * 8 / max(len(data), 1)
