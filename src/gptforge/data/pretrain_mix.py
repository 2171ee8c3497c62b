"""The built-in corpus with extra documents interleaved: a pretraining mix as token files.

    write_mix(PREFIX, tokenizer, lines, fraction=0.3)

takes the built-in corpus tokenized with `tokenizer` (data/corpus.py, prepared once into the
cache) and adds documents of `lines` (`per_doc` lines each, EOS-terminated like the corpus's)
until they are `fraction` of all tokens, placed among the corpus documents in a seeded random
order. The split of Data.*.dataset.split takes contiguous document ranges, so the interleaving
puts the added documents into every split in the same proportion. The result is an ordinary
`PREFIX_ids.npy` + `PREFIX_idx.npz` pair that `Data.Train.dataset.input_dir` reads.

What it is for: instruction tuning with LoRA adapts skills a base already has and cannot build
new circuits the way full fine-tuning (which moves every weight, the embeddings too) does. The
end-to-end benchmark pretrains on the built-in corpus mixed with unlabelled skill text
(`synthetic_instructions.skill_lines`: the operations written out, with no instruction words or
chat template) so that its small base, like a real pretrained model, holds the skills that
instruction tuning then asks for (benchmarks/results/2026-11-25-sft-end-to-end.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from gptforge.data.indexed import IDS_SUFFIX, IDX_SUFFIX, ids_dtype, load_token_files
from gptforge.errors import UsageError


def _documents(tokenizer, lines: Iterable[str], per_doc: int, want_tokens: int) -> list[list[int]]:
    """Tokenized documents of `per_doc` lines each (+ EOS) until they hold `want_tokens` tokens."""
    docs, total, it = [], 0, iter(lines)
    while total < want_tokens:
        chunk = [next(it) for _ in range(per_doc)]
        ids = tokenizer.encode("\n".join(chunk)) + [tokenizer.eos_token_id]
        docs.append(ids)
        total += len(ids)
    return docs


def write_mix(prefix: str | os.PathLike, tokenizer, lines: Iterable[str], fraction: float = 0.3,
              per_doc: int = 8, seed: int = 0, base_prefix: str | os.PathLike | None = None) -> dict:
    """Write the built-in corpus (or the token files at `base_prefix`, made with `tokenizer`) +
    documents of `lines` (`fraction` of the tokens) as token files at `prefix`; returns
    {"docs", "tokens", "added_docs", "added_tokens"}."""
    if not 0.0 < fraction < 1.0:
        raise UsageError(f"mix fraction: {fraction} must be between 0 and 1 (exclusive)")
    if base_prefix is None:
        from gptforge.data.corpus import builtin_token_files

        base_prefix = builtin_token_files(tokenizer)
    base = load_token_files(base_prefix)
    n_base = int(len(base.ids))
    added = _documents(tokenizer, lines, per_doc, int(n_base * fraction / (1.0 - fraction)))
    starts = np.concatenate([[0], np.cumsum(base.lens, dtype=np.int64)])
    order = np.concatenate([np.arange(base.n_docs), -1 - np.arange(len(added))])
    np.random.default_rng(seed).shuffle(order)
    dtype = np.result_type(base.ids.dtype, ids_dtype(tokenizer.vocab_size))
    parts = [np.asarray(base.ids[starts[d]:starts[d + 1]]) if d >= 0 else np.asarray(added[-1 - d], dtype=dtype)
             for d in order]
    ids = np.concatenate(parts).astype(dtype, copy=False)
    lens = np.asarray([len(p) for p in parts], dtype=np.int64)
    out = Path(prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    # temporary names renamed into place, the index last: a reader never sees half a mix
    ids_tmp, idx_tmp = Path(f"{out}{IDS_SUFFIX}.tmp"), Path(f"{out}{IDX_SUFFIX}.tmp")
    with open(ids_tmp, "wb") as f:
        np.save(f, ids)
    with open(idx_tmp, "wb") as f:
        np.savez(f, lens=lens, docs=np.arange(len(lens) + 1, dtype=np.int64))
    os.replace(ids_tmp, f"{out}{IDS_SUFFIX}")
    os.replace(idx_tmp, f"{out}{IDX_SUFFIX}")
    return {"docs": int(len(lens)), "tokens": int(len(ids)), "added_docs": len(added),
            "added_tokens": int(sum(len(d) for d in added))}
