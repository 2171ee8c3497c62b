"""`gptforge preprocess`: formats, streaming workers, bad input, atomic output, built-in corpus."""

from __future__ import annotations

import json
import multiprocessing
import os

import numpy as np
import pytest

from gptforge.data import corpus
from gptforge.data.indexed import ids_dtype, load_token_files
from gptforge.data.preprocess import preprocess_files
from gptforge.data.tokenizer import gpt2_tokenizer, train_tokenizer
from gptforge.errors import DataError

RAW = ("First document line one.\nline two of the first.\n\n\n"
       "tiny\n\n"
       "Second   document with <|endoftext|> inside.\n  \n"
       "Third document, café ☕.\n")


def outputs(d):
    return sorted(p.name for p in d.iterdir())


def ids_of(prefix):
    return np.load(f"{prefix}_ids.npy").tolist(), np.load(f"{prefix}_idx.npz")["lens"].tolist()


def test_text_documents_split_on_blank_lines(tmp_path):
    (tmp_path / "a.txt").write_text(RAW)
    tok = gpt2_tokenizer()
    st = preprocess_files([tmp_path / "a.txt"], tmp_path / "out" / "c", tok, append_eos=True, progress=False)
    docs = ["First document line one.\nline two of the first.", "Second   document with <|endoftext|> inside.",
            "Third document, café ☕."]
    want = [tok.encode(d) + [50256] for d in docs]
    ids, lens = ids_of(tmp_path / "out" / "c")
    assert ids == [i for w in want for i in w] and lens == [len(w) for w in want]
    assert st.documents == 3 and st.dropped == 1 and st.tokens == len(ids)
    assert outputs(tmp_path / "out") == ["c_ids.npy", "c_idx.npz", "c_meta.json"]
    idx = np.load(tmp_path / "out" / "c_idx.npz")
    assert idx["lens"].dtype == np.int32 and idx["docs"].dtype == np.int64 and idx["docs"].tolist() == [0, 1, 2, 3]
    meta = json.loads((tmp_path / "out" / "c_meta.json").read_text())
    assert meta["max_id"] == max(ids) and meta["fingerprint"] == tok.fingerprint()


def test_jsonl_zst_glob_order_and_workers(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    rows = [{"text": f"Row {i}: some words to tokenize, number {i * 13}.", "id": i} for i in range(400)]
    lines = [json.dumps(r) + "\n" for r in rows]
    (tmp_path / "b.jsonl").write_text("".join(lines[:150]))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(lines[150:]).encode()))
    tok = gpt2_tokenizer()
    preprocess_files([str(tmp_path / "*.jsonl*")], tmp_path / "one", tok, workers=1, progress=False)
    preprocess_files([tmp_path], tmp_path / "two", tok, workers=2, progress=False)
    one, two = ids_of(tmp_path / "one"), ids_of(tmp_path / "two")
    assert one == two
    assert one[1] == [len(tok.encode(r["text"])) for r in rows]


def test_custom_vocab_uses_hf_and_small_dtype(tmp_path):
    (tmp_path / "a.txt").write_text(RAW * 20)
    tok = train_tokenizer([RAW] * 50, 300, show_progress=False)
    preprocess_files([tmp_path / "a.txt"], tmp_path / "s", tok, workers=2, progress=False)
    ids, lens = ids_of(tmp_path / "s")
    assert np.load(tmp_path / "s_ids.npy").dtype == np.uint16 and max(ids) < 300
    assert ids[:lens[0]] == tok.encode("First document line one.\nline two of the first.")
    assert ids_dtype(50257) == np.uint16 and ids_dtype(65535) == np.int32 and ids_dtype(100000) == np.int32


@pytest.mark.parametrize("content,kind,match", [
    ("", "txt", "empty input"),
    ("a\n\nb\n\nshort\n", "txt", "no documents left after filtering"),
    ('{"text": "fine document here"}\n{"body": "x"}\n', "jsonl", r"b\.jsonl:2: no key 'text'"),
    ('{"text": 12}\n', "jsonl", "not a string"),
    ('{"text": "ok"\n', "jsonl", "invalid JSON"),
    ("[1, 2]\n", "jsonl", "expected a JSON object"),
])
def test_bad_input_leaves_nothing(tmp_path, content, kind, match):
    src = tmp_path / f"b.{kind}"
    src.write_text(content)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataError, match=match):
        preprocess_files([src], out / "p", gpt2_tokenizer(), progress=False)
    assert outputs(out) == []


def test_output_prefix_problems(tmp_path):
    (tmp_path / "a.txt").write_text(RAW)
    with pytest.raises(DataError, match="is a directory"):
        preprocess_files([tmp_path / "a.txt"], tmp_path, gpt2_tokenizer(), progress=False)
    with pytest.raises(DataError, match="no documents"):  # a failed run removes the directories it made
        preprocess_files([tmp_path / "a.txt"], tmp_path / "new" / "deeper" / "p", gpt2_tokenizer(),
                         min_doc_length=10_000, progress=False)
    assert not (tmp_path / "new").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DataError, match="cannot create"):
        preprocess_files([tmp_path / "a.txt"], blocker / "p", gpt2_tokenizer(), progress=False)


def test_invalid_utf8_replaced_or_rejected(tmp_path, run_cli):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"Good text here, long enough.\n\nBroken \xff\xfe bytes in this one.\n")
    st = preprocess_files([src], tmp_path / "r", gpt2_tokenizer(), progress=False)
    assert st.invalid_utf8_replaced == 2 and st.documents == 2
    code, out, err = run_cli("preprocess", "--input", src, "--output-prefix", tmp_path / "s", "--strict", "--no-progress")
    assert code == 2 and "invalid UTF-8" in err and "bad.txt" in err and len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob("s_*")) and not list(tmp_path.glob(".s*"))


def test_lone_surrogate_escapes(tmp_path):
    src = tmp_path / "s.jsonl"
    src.write_text('{"text": "broken \\ud800 escape in a long enough text"}\n')
    st = preprocess_files([src], tmp_path / "r", gpt2_tokenizer(), progress=False)
    assert st.invalid_utf8_replaced == 1 and st.documents == 1
    with pytest.raises(DataError, match="lone surrogate"):
        preprocess_files([src], tmp_path / "q", gpt2_tokenizer(), strict=True, progress=False)


def test_worker_error_cleans_up(tmp_path):
    good = "".join(json.dumps({"text": f"document {i} with enough text"}) + "\n" for i in range(30000))
    (tmp_path / "a.jsonl").write_text(good + '{"other": 1}\n')  # error in a late chunk, inside a worker
    with pytest.raises(DataError, match="no key 'text'"):
        preprocess_files([tmp_path / "a.jsonl"], tmp_path / "o" / "p", gpt2_tokenizer(), workers=2, progress=False)
    assert not (tmp_path / "o").exists()


def test_rewrite_replaces_outputs_and_stale_index_maps(tmp_path):
    from gptforge.data.dataset import GPTDataset

    (tmp_path / "a.txt").write_text("\n\n".join(f"Document {i} is a reasonable sentence." for i in range(50)))
    tok = gpt2_tokenizer()
    preprocess_files([tmp_path / "a.txt"], tmp_path / "p", tok, progress=False)
    files = load_token_files(tmp_path / "p")
    GPTDataset(files, "Train", np.arange(50, dtype=np.int32), 8, 10, seed=0)
    assert list(tmp_path.glob("p_gpt_Train_indexmap_*"))
    preprocess_files([tmp_path / "a.txt"], tmp_path / "p", tok, append_eos=True, progress=False)
    assert not list(tmp_path.glob("p_gpt_*")) and not list(tmp_path.glob(".p*"))
    assert load_token_files(tmp_path / "p").n_docs == 50


def test_cli_preprocess(run_cli, tmp_path):
    (tmp_path / "a.txt").write_text(RAW)
    code, out, err = run_cli("preprocess", "--input", tmp_path / "a.txt", "--output-prefix", tmp_path / "x",
                             "--append-eos", "--no-progress")
    assert code == 0, err
    assert "3 documents" in out and "MB/s" in out and "1 document(s)" in out
    code, _, err = run_cli("preprocess", "--input", tmp_path / "nope.txt", "--output-prefix", tmp_path / "y")
    assert code == 2 and "nope.txt" in err
    code, _, err = run_cli("preprocess", "--output-prefix", tmp_path / "y")
    assert code == 2 and "--builtin" in err


def test_builtin_corpus_is_real_and_deterministic():
    docs = corpus.builtin_documents()
    size = sum(len(d) for d in docs)
    assert size > 5_000_000 and len(docs) > 2000
    assert any("def " in d for d in docs) and any(d.startswith("Return") for d in docs)
    files = corpus.source_files()
    assert files == corpus.source_files() and not any("site-packages" in str(f) or "/test/" in str(f) for f in files)
    assert corpus.corpus_fingerprint() == corpus.corpus_fingerprint()


def _prepare_in_process(cache, q):
    tok = train_tokenizer(["tiny built-in corpus text for a race"] * 20, 270, show_progress=False)
    q.put(str(corpus.builtin_token_files(tok, cache=cache)))


def test_builtin_dataset_cache_and_race(tmp_path, monkeypatch):
    from gf_testutil import tiny_config
    from gptforge.data.dataset import build_datasets

    small = [f"Built-in document {i}: the standard library has many modules and docstrings." for i in range(300)]
    monkeypatch.setattr(corpus, "builtin_documents", lambda parts=("prose", "code"): small)
    monkeypatch.setenv("GPTFORGE_CACHE", str(tmp_path / "cache"))
    # Two processes racing to prepare the same corpus both succeed and agree.
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_process, args=(tmp_path / "race", q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    a, b = q.get(), q.get()
    assert a == b and load_token_files(a).n_docs == 300
    assert not [n for n in os.listdir(os.path.dirname(a)) if n.endswith(".tmp")]
    cfg = tiny_config("Model.vocab_size=50304", "Data.Train.dataset.input_dir=builtin",
                      "Data.Eval.dataset.input_dir=builtin", "Data.Train.dataset.max_seq_len=32",
                      "Data.Eval.dataset.max_seq_len=32", "Engine.max_steps=10", "Engine.eval_freq=5",
                      "Engine.eval_iters=1", "Global.global_batch_size=2")
    ds = build_datasets(cfg)
    assert len(ds["Train"]) >= 20 and len(ds["Eval"]) >= 6
    assert list((tmp_path / "cache" / "builtin").glob("*/builtin_idx.npz"))
    again = build_datasets(cfg)  # the second time comes from the cache
    np.testing.assert_array_equal(again["Train"][3]["tokens"], ds["Train"][3]["tokens"])


def test_cli_builtin_and_tokenizer_train_builtin(run_cli, tmp_path, monkeypatch):
    small = [f"Module {i} docstring: Return the value of the {i}th item, or raise KeyError." for i in range(200)]
    monkeypatch.setattr(corpus, "builtin_documents", lambda parts=("prose", "code"): small)
    code, out, err = run_cli("tokenizer", "train", "--builtin", "--vocab-size", "320", "--out", tmp_path / "tok",
                             "--no-progress")
    assert code == 0, err
    code, out, err = run_cli("preprocess", "--builtin", "--tokenizer", tmp_path / "tok", "--output-prefix",
                             tmp_path / "b", "--no-progress")
    assert code == 0, err
    files = load_token_files(tmp_path / "b")
    assert files.n_docs == 200 and files.max_id() < 320
    assert files.ids[files.lens[0] - 1] == 319  # --builtin appends EOS (the trained vocabulary's last id)
