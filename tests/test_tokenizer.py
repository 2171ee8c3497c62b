"""Our GPT-2 ids equal transformers' GPT2TokenizerFast and tiktoken built from the same files."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from gptforge.data.preprocess import preprocess_documents
from gptforge.data.tokenizer import (
    EOS_TOKEN,
    gpt2_tokenizer,
    gpt2_vocab_files,
    load_tokenizer,
    tiktoken_gpt2,
    train_tokenizer,
)
from gptforge.errors import DataError

TEXT = (
    "Hello, world! It's a test: we'll see what they've done, I'm sure. DON'T SHOUT.\n"
    "Unicode: café naïve Ångström Straße 東京タワー 北京 Привет мир שלום مرحبا ελληνικά हिन्दी\n"
    "Emoji: 🤖🎉 👩‍💻 👍🏽 🇫🇷 ❤️ ☕\n"
    "Digits: 0 7 42 1234567890 3.14159 1,000,000 2026-11-22 0x1F 1e-5 ½ ²³ ٣٤\n"
    "Whitespace runs:   three spaces,\ttab,\t\ttwo tabs,\n\n\nthree newlines,  \n trailing  \r\n"
    "crlf\u00a0nbsp\u3000ideographic space      \n"
    "Special: first<|endoftext|>second <|endoftext|> third<|endoftext|>\n"
    "<|endoftext|>Code: def f(x):\n    return x**2  # square\n\tif a != b: pass\n"
    "Punctuation: ... --- !!! ??? «quotes» “smart” ‘single’ (parens) [brackets] {braces} @#$%^&*\n"
    "   leading spaces and trailing spaces   "
)


def reference_tiktoken():
    """tiktoken's own GPT-2 recipe (its pattern and hashes), pointed at the local files."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    enc, bpe = gpt2_vocab_files()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(bpe), encoder_json_file=str(enc),
        vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")
    return tiktoken.Encoding("gpt2-ref", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOS_TOKEN: 50256}, explicit_n_vocab=50257)


@pytest.fixture(scope="module")
def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    enc, bpe = gpt2_vocab_files()
    tok = transformers.GPT2TokenizerFast(vocab=str(enc), merges=str(bpe))  # NOT vocab_file= (ignored in 5.x)
    assert len(tok) == 50257 and tok.eos_token_id == 50256
    return tok


def fuzz_texts(n=150, seed=0):
    rng = random.Random(seed)
    pool = list("abcXYZ019 ,.'!?-_\t\n\r") + ["  ", "   ", "\n\n", "'s", "'ll", "'RE", "é", "ß", "東", "🤖",
                                            "👍🏽", "\u00a0", "\u3000", "\u200d", "١", "<|endoftext|>", "12345"]
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 60))) for _ in range(n)]


def test_gpt2_files_are_openai_originals():
    enc, bpe = gpt2_vocab_files()
    assert hashlib.sha256(bpe.read_bytes()).hexdigest().startswith("1ce1664773c50f3e")
    assert hashlib.sha256(enc.read_bytes()).hexdigest().startswith("196139668be63f3b")


def test_gpt2_ids_equal_transformers_and_tiktoken(hf_gpt2):
    ours = gpt2_tokenizer()
    want_hf = hf_gpt2(TEXT)["input_ids"]
    want_tk = reference_tiktoken().encode(TEXT, allowed_special="all")
    assert want_hf == want_tk  # the two references agree with each other
    assert ours.encode(TEXT) == want_hf
    assert tiktoken_gpt2().encode(TEXT, allowed_special="all") == want_hf  # preprocess's fast path
    assert want_hf.count(50256) == 4 and ours.eos_token_id == 50256 and ours.vocab_size == 50257
    assert ours.decode(ours.encode(TEXT)) == TEXT


def test_gpt2_fuzz_parity(hf_gpt2):
    texts = fuzz_texts()
    ours = gpt2_tokenizer().encode_batch(texts)
    ref = reference_tiktoken()
    fast = tiktoken_gpt2()
    for text, ids in zip(texts, ours, strict=True):
        assert ids == hf_gpt2(text)["input_ids"] == ref.encode(text, allowed_special="all"), repr(text)
        assert fast.encode(text, allowed_special="all") == ids


def test_preprocess_ids_equal_transformers(tmp_path, hf_gpt2):
    docs = [TEXT, *fuzz_texts(40, seed=1)]
    kept = [d.strip() for d in docs if len(d) > 10 and d.strip()]
    want = [hf_gpt2(d)["input_ids"] + [50256] for d in kept]
    preprocess_documents(docs, tmp_path / "p", gpt2_tokenizer(), append_eos=True, workers=1, progress=False)
    ids = np.load(tmp_path / "p_ids.npy")
    idx = np.load(tmp_path / "p_idx.npz")
    assert ids.dtype == np.uint16
    assert idx["lens"].tolist() == [len(w) for w in want]
    assert idx["docs"].tolist() == list(range(len(want) + 1))
    assert ids.tolist() == [i for w in want for i in w]


def test_trained_tokenizer_round_trip_and_hf_parity(tmp_path):
    transformers = pytest.importorskip("transformers")
    corpus = [f"The quick brown fox {i} jumps over the lazy dog number {i * 7}. Ünïcödé 🤖 text." for i in range(300)]
    tok = train_tokenizer(corpus, 400, show_progress=False)
    assert tok.vocab_size == 400 and tok.eos_token_id == 399
    tok.save(tmp_path / "tok")
    again = load_tokenizer(str(tmp_path / "tok"))
    sample = "The lazy fox 🤖 jumps<|endoftext|>over 1234 dogs.\n\n  end"
    assert again.encode(sample) == tok.encode(sample) and again.fingerprint() == tok.fingerprint()
    assert again.decode(again.encode(sample)) == sample
    # Files HF transformers reads give the same ids (vocab.json + merges.txt, and tokenizer.json).
    hf = transformers.GPT2TokenizerFast(vocab=str(tmp_path / "tok" / "vocab.json"),
                                        merges=str(tmp_path / "tok" / "merges.txt"))
    assert hf(sample)["input_ids"] == tok.encode(sample)
    vm = load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    assert vm.encode(sample) == tok.encode(sample)


def test_load_tokenizer_errors_and_checkpoint_dir(tmp_path):
    with pytest.raises(DataError, match="neither"):
        load_tokenizer(str(tmp_path / "missing"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not a tokenizers JSON"):
        load_tokenizer(str(bad))
    gpt2_tokenizer().save(tmp_path / "ckpt")
    tok = load_tokenizer(None, tmp_path / "ckpt")  # a checkpoint carries its tokenizer
    assert tok.is_gpt2() and tok.encode("hi <|endoftext|>") == [5303, 220, 50256]
    with pytest.raises(DataError, match="at least"):
        train_tokenizer(["abc"], 100, show_progress=False)


def test_tokenizer_cli(run_cli, tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(f"Document number {i} talks about tokenizers and byte pairs." for i in range(200)))
    code, out, err = run_cli("tokenizer", "train", "--input", src, "--vocab-size", "300", "--out",
                             tmp_path / "tok", "--no-progress")
    assert code == 0, err
    assert "300 tokens" in out and (tmp_path / "tok" / "tokenizer.json").is_file()
    code, out, _ = run_cli("tokenizer", "show", "--tokenizer", tmp_path / "tok")
    assert code == 0 and "vocab_size: 300" in out and "eos_token_id: 299" in out
    code, out, _ = run_cli("tokenizer", "encode", "--tokenizer", "gpt2", "Hello<|endoftext|>")
    assert out.split() == ["15496", "50256"]
    code, out, _ = run_cli("tokenizer", "decode", "15496", "50256")
    assert out == "Hello<|endoftext|>\n"
    code, _, err = run_cli("tokenizer", "train", "--input", src, "--vocab-size", "300", "--out", tmp_path / "tok")
    assert code == 2 and "already exists" in err and len(err.strip().splitlines()) == 1
