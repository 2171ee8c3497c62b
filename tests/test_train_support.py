"""Helpers shared by the training tests (no tests here): a small tokenizer, a small token
corpus in the reference's file format, and a tiny training config pointing at it."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from gf_testutil import tiny_config

VOCAB = 512  # ids in the synthetic corpus; the tiny preset's model vocabulary is 4096


@functools.lru_cache(maxsize=1)
def small_tokenizer():
    """A byte-level BPE with a few hundred tokens (fits the tiny model's vocabulary)."""
    from gptforge.data.tokenizer import train_tokenizer

    text = ["the quick brown fox jumps over the lazy dog. " * 4, "pack my box with five dozen liquor jugs. " * 4,
            "sphinx of black quartz, judge my vow. " * 4]
    return train_tokenizer(text * 20, vocab_size=300, show_progress=False)


def write_corpus(root: Path, n_docs: int = 120, seed: int = 0, name: str = "corpus") -> Path:
    """`<root>/<name>_ids.npy` + `_idx.npz`: documents that repeat one of a few short token
    patterns (learnable, so the loss of a tiny model falls within a few dozen steps)."""
    rng = np.random.RandomState(seed)
    patterns = [rng.randint(1, VOCAB, size=rng.randint(3, 8)) for _ in range(6)]
    docs = []
    for _ in range(n_docs):
        pat = patterns[rng.randint(len(patterns))]
        n = rng.randint(20, 80)
        docs.append(np.resize(np.roll(pat, rng.randint(len(pat))), n))
    root.mkdir(parents=True, exist_ok=True)
    lens = np.array([len(d) for d in docs], dtype=np.int32)
    np.save(root / f"{name}_ids.npy", np.concatenate(docs).astype(np.uint16))
    np.savez(root / f"{name}_idx.npz", lens=lens, docs=np.arange(n_docs + 1, dtype=np.int64))
    return root / name


def train_config(tmp_path: Path, *overrides: str, dropout: float = 0.0, steps: int = 8):
    """A resolved tiny training config over a synthetic corpus under `tmp_path`."""
    prefix = tmp_path / "data" / "corpus"
    if not Path(str(prefix) + "_idx.npz").is_file():
        write_corpus(prefix.parent)
    tok_dir = tmp_path / "tok"
    if not (tok_dir / "tokenizer.json").is_file():
        small_tokenizer().save(tok_dir)
    return tiny_config(
        "Global.device=cpu", "Global.global_batch_size=4", "Global.micro_batch_size=2",
        f"Engine.max_steps={steps}", "Engine.logging_freq=1", "Engine.eval_freq=4", "Engine.eval_iters=2",
        "Engine.mix_precision.enable=False", f"Engine.save_load.output_dir={tmp_path / 'out'}",
        "Engine.save_load.save_steps=4", "Optimizer.lr.max_lr=2e-3", "Optimizer.lr.min_lr=1e-4",
        f"Optimizer.lr.decay_steps={steps}", "Optimizer.lr.warmup_rate=0.25",
        f"Model.hidden_dropout_prob={dropout}", f"Model.attention_probs_dropout_prob={dropout}",
        f"Data.tokenizer={tok_dir}",
        *(f"Data.{s}.dataset.{k}" for s in ("Train", "Eval") for k in (f"input_dir={prefix}", "max_seq_len=32")),
        "Data.Train.loader.num_workers=0", "Data.Eval.loader.num_workers=0",
        *overrides,
    )


def state_equal(a: dict, b: dict) -> bool:
    """Bitwise equality of two state dicts."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
