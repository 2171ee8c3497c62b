"""GPTDataset / index maps / sampler against an independent transcription of Megatron's algorithm."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gf_testutil import tiny_config
from gptforge.data.dataset import GPTBatchSampler, GPTDataset, build_datasets, collate, default_num_samples
from gptforge.data.index_map import compute_index_maps, num_epochs_for, split_boundaries
from gptforge.data.indexed import load_token_files
from gptforge.errors import DataError

# ------------------------------------------------------------------ the reference, written out
# Megatron-LM `gpt_dataset.py` (_num_epochs, _build_doc_idx, _build_shuffle_idx, the separate-
# last-epoch rule) and `helpers.cpp::build_sample_idx`, transcribed as plain loops.


def ref_num_epochs(tokens_per_epoch, seq_length, num_samples):
    num_epochs, total = 0, 0
    while True:
        num_epochs += 1
        total += tokens_per_epoch
        if (total - 1) // seq_length >= num_samples:
            return num_epochs


def ref_doc_idx(documents, num_epochs, rng, separate_last_epoch):
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.mgrid[0:num_epochs, 0:len(documents)][1]
        doc_idx[:] = documents
        doc_idx = doc_idx.reshape(-1).astype(np.int32)
        rng.shuffle(doc_idx)
        return doc_idx
    first = ref_doc_idx(documents, num_epochs - 1, rng, False)
    last = ref_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros([num_samples + 1, 2], dtype=np.int64)
    sample_index = doc_idx_index = doc_offset = 0
    sample_idx[0] = (0, 0)
    sample_index += 1
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return sample_idx


def ref_shuffle_idx(num_samples, total_size, rng):
    first = np.arange(0, num_samples, dtype=np.uint32)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.uint32)
    rng.shuffle(last)
    return np.concatenate((first, last))


def ref_index_maps(sizes, documents, num_samples, seq_length, seed):
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs = ref_num_epochs(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    if num_epochs == 1:
        separate = False
    else:
        from_first = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        last = num_samples - from_first
        per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= last < per_epoch + 1
        separate = last < int(0.80 * per_epoch)
    doc_idx = ref_doc_idx(documents, num_epochs, rng, separate)
    sample_idx = ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    n = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else sample_idx.shape[0] - 1
    shuffle_idx = ref_shuffle_idx(n, sample_idx.shape[0] - 1, rng)
    return doc_idx, sample_idx, shuffle_idx, num_epochs, separate


def ref_sample(ids, sizes, doc_idx, sample_idx, shuffle_idx, i):
    starts = np.concatenate([[0], np.cumsum(sizes)])
    j = shuffle_idx[i]
    (d0, o0), (d1, o1) = sample_idx[j], sample_idx[j + 1]
    if d0 == d1:
        a = starts[doc_idx[d0]] + o0
        return ids[a:a + o1 - o0 + 1]
    parts = [ids[starts[doc_idx[d0]] + o0:starts[doc_idx[d0] + 1]]]
    parts += [ids[starts[doc_idx[d]]:starts[doc_idx[d] + 1]] for d in range(d0 + 1, d1)]
    parts.append(ids[starts[doc_idx[d1]]:starts[doc_idx[d1]] + o1 + 1])
    return np.concatenate(parts)


def write_corpus(tmp_path, n_docs, seed=0, name="corpus", lo=1, hi=60, vocab=1000):
    rng = np.random.RandomState(seed)
    lens = rng.randint(lo, hi, size=n_docs).astype(np.int32)
    ids = rng.randint(0, vocab, size=int(lens.sum())).astype(np.uint16)
    prefix = tmp_path / name
    np.save(f"{prefix}_ids.npy", ids)
    np.savez(f"{prefix}_idx.npz", lens=lens, docs=np.arange(n_docs + 1, dtype=np.int64))
    return prefix, ids, lens


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("n_docs,seq_len,epochs_wanted,frac,separate_wanted", [
    (7, 16, 1, 0.5, False), (50, 32, 1, 1.0, False), (50, 32, 2, 0.5, True), (50, 32, 2, 0.95, False),
    (200, 64, 3, 0.3, True), (200, 64, 3, 0.9, False), (1000, 128, 2, 0.79, True), (1000, 128, 2, 0.81, False),
    (3, 8, 3, 1.0, False),
])
def test_index_maps_equal_megatron(n_docs, seq_len, epochs_wanted, frac, separate_wanted):
    rng = np.random.RandomState(n_docs)
    sizes = rng.randint(0, 90, size=n_docs + 5).astype(np.int32)  # includes empty documents
    documents = np.arange(2, n_docs + 2, dtype=np.int32)
    tpe = int(sizes[documents].sum())
    per_epoch = (tpe - 1) // seq_len
    base = ((epochs_wanted - 1) * tpe - 1) // seq_len if epochs_wanted > 1 else 0
    num_samples = max(1, base + int(frac * per_epoch))
    doc_idx, sample_idx, shuffle_idx, epochs, separate = ref_index_maps(sizes, documents, num_samples, seq_len, 1234)
    assert (epochs, separate) == (epochs_wanted, separate_wanted)  # the case is the one named
    maps = compute_index_maps(sizes, documents, seq_len, num_samples, 1234)
    assert maps.num_epochs == epochs
    np.testing.assert_array_equal(maps.doc_idx, doc_idx)
    np.testing.assert_array_equal(maps.sample_idx, sample_idx)
    np.testing.assert_array_equal(maps.shuffle_idx, shuffle_idx)
    assert maps.shuffle_idx.dtype == np.uint32 and maps.doc_idx.dtype == np.int32


def test_separate_last_epoch_cases_are_exercised():
    sizes = np.full(100, 33, dtype=np.int32)
    docs = np.arange(100, dtype=np.int32)
    per_epoch = (3300 - 1) // 32
    # 2 epochs with a small last epoch (separate) and with a large one (not separate).
    assert ref_index_maps(sizes, docs, per_epoch + 10, 32, 1)[4] is True
    assert ref_index_maps(sizes, docs, 2 * per_epoch - 1, 32, 1)[4] is False


def test_num_epochs_closed_form():
    for tpe in (17, 100, 1025):
        for seq in (1, 8, 16):
            if tpe <= seq:
                continue
            for ns in (0, 1, 5, 63, 64, 65, 1000):
                assert num_epochs_for(tpe, seq, ns) == ref_num_epochs(tpe, seq, ns)


@pytest.mark.parametrize("weights,size", [([949, 50, 1], 1000), ("969,30,1", 57), ([1, 1, 1], 10), ([1, 0, 0], 5),
                                          ([98, 2, 0], 3)])
def test_split_boundaries(weights, size):
    w = [float(x) for x in (weights.split(",") if isinstance(weights, str) else weights)]
    w = [x / sum(w) for x in w]
    ref = [0]
    for x in w:
        ref.append(ref[-1] + int(round(x * float(size))))
    diff = ref[-1] - size
    ref = [ref[0]] + [b - diff for b in ref[1:]]
    assert split_boundaries(weights, size) == ref


def test_dataset_samples_match_reference(tmp_path):
    prefix, ids, lens = write_corpus(tmp_path, 80)
    files = load_token_files(prefix)
    docs = np.arange(0, 70, dtype=np.int32)
    ds = GPTDataset(files, "Train", docs, 24, 150, seed=7)
    doc_idx, sample_idx, shuffle_idx, *_ = ref_index_maps(lens, docs, 150, 24, 7)
    assert len(ds) == len(sample_idx) - 1 >= 150
    for i in range(len(ds)):
        want = ref_sample(ids, lens, doc_idx, sample_idx, shuffle_idx, i).astype(np.int64)
        item = ds[i]
        np.testing.assert_array_equal(item["tokens"], want[:-1])
        np.testing.assert_array_equal(item["labels"], want[1:])
    assert item["position_ids"].tolist() == list(range(24)) and item["loss_mask"].dtype == np.float32
    assert item["loss_mask"].sum() == 24
    # Consecutive samples of the unshuffled stream share their boundary token.
    inv = np.argsort(ds.shuffle_idx)
    assert ds.sample_tokens(int(inv[0]))[-1] == ds.sample_tokens(int(inv[1]))[0]


def test_cache_files_reuse_and_invalidation(tmp_path, capsys):
    prefix, _, _ = write_corpus(tmp_path, 40)
    files = load_token_files(prefix)
    docs = np.arange(40, dtype=np.int32)
    a = GPTDataset(files, "Eval", docs, 16, 30, seed=1)
    names = sorted(p.name for p in tmp_path.glob("corpus_gpt_*.npy"))
    assert names == [f"corpus_gpt_Eval_indexmap_30ns_16sl_{k}_idx.npy" for k in ("doc", "sample", "shuffle")]
    capsys.readouterr()
    b = GPTDataset(files, "Eval", docs, 16, 30, seed=1)
    assert "built" not in capsys.readouterr().err  # loaded from the cache
    np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)
    c = GPTDataset(files, "Eval", docs, 16, 30, seed=2)  # another seed must not reuse the cache
    np.testing.assert_array_equal(c.shuffle_idx, compute_index_maps(files.lens, docs, 16, 30, 2).shuffle_idx)


def test_read_only_data_dir_uses_cache(tmp_path, monkeypatch):
    data = tmp_path / "ro"
    data.mkdir()
    prefix, _, _ = write_corpus(data, 30)
    monkeypatch.setenv("GPTFORGE_CACHE", str(tmp_path / "cache"))
    real_access = os.access
    # Root ignores permission bits, so the read-only directory is simulated where it is asked about.
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(data) else real_access(p, mode))
    GPTDataset(load_token_files(prefix), "Train", np.arange(30, dtype=np.int32), 8, 20, seed=3)
    assert list((tmp_path / "cache" / "indexmaps").rglob("corpus_gpt_Train_indexmap_20ns_8sl_doc_idx.npy"))
    assert not list(data.glob("*_gpt_*"))


def uninterrupted(n, lbs, world, steps, start=0):
    """Batches of every rank for `steps` global steps, via fresh samplers at consumed 0."""
    its = [iter(GPTBatchSampler(n, lbs, r, world, 0)) for r in range(world)]
    out = []
    for _ in range(steps):
        out.append([next(it) for it in its])
    return out[start:]


@pytest.mark.parametrize("n,lbs,world", [(100, 4, 1), (100, 3, 2), (37, 2, 4), (64, 8, 2)])
def test_sampler_resume_equals_uninterrupted(n, lbs, world):
    gbs = lbs * world
    per_pass = len(GPTBatchSampler(n, lbs, 0, world))
    full = uninterrupted(n, lbs, world, per_pass)
    for k_steps in (0, 1, 3, per_pass - 1):
        resumed = [list(GPTBatchSampler(n, lbs, r, world, consumed_samples=k_steps * gbs)) for r in range(world)]
        assert [list(step) for step in zip(*resumed, strict=True)] == full[k_steps:]
    # A global step is a contiguous block of gbs indices; ranks take consecutive slices.
    step0 = [b for rank in full[0] for b in rank]
    assert step0 == [i % n for i in range(gbs)]


def test_sampler_resume_in_a_later_pass_and_wraparound():
    s = GPTBatchSampler(10, 2, 0, 1)
    first_pass = list(s)
    assert first_pass == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]] and list(s) == first_pass
    resumed = GPTBatchSampler(10, 2, 0, 1, consumed_samples=14)  # step 7 = pass 2, step 2
    assert list(resumed) == first_pass[2:] and list(resumed) == first_pass
    r1 = list(GPTBatchSampler(7, 2, 1, 2, drop_last=True))  # total 8: index 7 wraps to 0
    assert r1 == [[2, 3], [6, 0]]
    assert list(GPTBatchSampler(7, 2, 0, 1, drop_last=False))[-1] == [6]


def test_collate_shapes_and_dtypes(tmp_path):
    prefix, _, _ = write_corpus(tmp_path, 30)
    ds = GPTDataset(load_token_files(prefix), "Train", np.arange(30, dtype=np.int32), 12, 20, seed=0)
    batch = collate([ds[i] for i in range(3)])
    assert batch["tokens"].shape == (3, 12) and batch["tokens"].dtype == torch.int64
    assert batch["labels"].dtype == torch.int64 and batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    loader = torch.utils.data.DataLoader(ds, batch_sampler=GPTBatchSampler(len(ds), 4), collate_fn=collate,
                                         num_workers=1)
    first = next(iter(loader))
    assert torch.equal(first["tokens"], collate([ds[i] for i in range(4)])["tokens"])


def cfg_for(prefix, *extra):
    return tiny_config("Model.vocab_size=50304", f"Data.Train.dataset.input_dir={prefix}",
                       f"Data.Eval.dataset.input_dir={prefix}", "Data.Train.dataset.max_seq_len=16",
                       "Data.Eval.dataset.max_seq_len=16", "Engine.max_steps=20", "Engine.eval_freq=10",
                       "Engine.eval_iters=2", "Global.global_batch_size=4", *extra)


def test_build_datasets_from_config(tmp_path):
    prefix, ids, lens = write_corpus(tmp_path, 200, vocab=50000)
    cfg = cfg_for(tmp_path)  # a directory: its first *_idx.npz
    out = build_datasets(cfg)
    assert set(out) == {"Train", "Eval"}
    assert default_num_samples(cfg, "Train") == 80 and default_num_samples(cfg, "Eval") == 4 * 3 * 2
    assert len(out["Train"]) >= 80 and len(out["Eval"]) >= 24
    b = split_boundaries([949, 50, 1], 200)
    doc_idx, sample_idx, shuffle_idx, *_ = ref_index_maps(lens, np.arange(b[1], b[2]), 24, 16, cfg.Global.seed)
    np.testing.assert_array_equal(out["Eval"][5]["tokens"],
                                  ref_sample(ids, lens, doc_idx, sample_idx, shuffle_idx, 5)[:-1])


def test_eval_defaults_to_the_train_corpus(tmp_path, monkeypatch):
    write_corpus(tmp_path, 100, vocab=50000)
    monkeypatch.chdir(tmp_path)  # no ./data/ here
    cfg = tiny_config("Model.vocab_size=50304", f"Data.Train.dataset.input_dir={tmp_path}",
                      "Data.Train.dataset.max_seq_len=16", "Data.Eval.dataset.max_seq_len=16", "Engine.max_steps=4",
                      "Engine.eval_iters=1")
    out = build_datasets(cfg)
    assert out["Eval"].prefix == out["Train"].prefix == tmp_path / "corpus"


def test_build_datasets_errors(tmp_path):
    prefix, _, _ = write_corpus(tmp_path, 200, vocab=50000)
    with pytest.raises(DataError, match="Eval split"):
        build_datasets(cfg_for(prefix, "Data.Eval.dataset.split=[1,0,0]"))
    with pytest.raises(DataError, match="max_seq_len"):
        build_datasets(cfg_for(prefix, "Data.Eval.dataset.max_seq_len=100000"))
    with pytest.raises(DataError, match="vocab_size"):
        build_datasets(cfg_for(prefix, "Model.vocab_size=4096"))
    with pytest.raises(DataError, match="not found"):
        build_datasets(cfg_for(tmp_path / "nope"))


def test_corrupted_token_files(tmp_path):
    prefix, ids, lens = write_corpus(tmp_path, 20)
    ids_file = f"{prefix}_ids.npy"
    np.savez(f"{prefix}_idx.npz", lens=lens[:-1], docs=np.arange(20))
    with pytest.raises(DataError, match="sum to"):
        load_token_files(prefix)
    np.savez(f"{prefix}_idx.npz", lens=lens, docs=np.arange(21))
    with open(ids_file, "r+b") as f:
        f.truncate(os.path.getsize(ids_file) - 10)
    with pytest.raises(DataError, match="truncated or corrupted"):
        load_token_files(prefix)
    with open(f"{prefix}_idx.npz", "wb") as f:
        f.write(b"not a zip")
    np.save(ids_file, ids)
    with pytest.raises(DataError, match="corrupted"):
        load_token_files(prefix)


def test_legacy_npz_is_read_with_warning(tmp_path, capsys):
    rng = np.random.RandomState(0)
    lens = rng.randint(5, 30, size=25).astype(np.int32)
    ids = rng.randint(0, 500, size=int(lens.sum())).astype(np.int32)
    np.savez(tmp_path / "old_ids.npz", ids=ids, lens=lens)
    files = load_token_files(tmp_path / "old")
    assert "legacy" in capsys.readouterr().err
    ds = GPTDataset(files, "Train", np.arange(25, dtype=np.int32), 8, 10, seed=0)
    assert ds[0]["tokens"].shape == (8,)


def _dist_worker(rank, world, init_file, prefix, out_dir):
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ds = GPTDataset(load_token_files(prefix), "Train", np.arange(60, dtype=np.int32), 16, 200, seed=5)
        np.save(os.path.join(out_dir, f"shuffle{rank}.npy"), np.asarray(ds.shuffle_idx))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_index_maps_under_torch_distributed(tmp_path):
    import multiprocessing

    prefix, _, lens = write_corpus(tmp_path, 60)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_dist_worker, args=(r, 2, tmp_path / "init", prefix, tmp_path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    want = ref_index_maps(lens, np.arange(60), 200, 16, 5)[2]
    for r in range(2):
        np.testing.assert_array_equal(np.load(tmp_path / f"shuffle{r}.npy"), want)


def test_vocab_checks_name_the_problem(tmp_path):
    from gptforge.data.preprocess import preprocess_documents
    from gptforge.data.tokenizer import train_tokenizer

    small = train_tokenizer([f"words and more words {i}" for i in range(100)], 300, show_progress=False)
    (tmp_path / "a").mkdir()
    write_corpus(tmp_path / "a", 200, vocab=50000)
    with pytest.raises(DataError, match="holds token id"):  # a fitting tokenizer, ids beyond the model
        build_datasets(cfg_for(tmp_path / "a" / "corpus", "Model.vocab_size=4096"), tokenizer=small)
    docs = [f"Document {i}: words and more words to fill a sample or two." for i in range(200)]
    preprocess_documents(docs, tmp_path / "b" / "small", small, progress=False)
    with pytest.raises(DataError, match="was tokenized with"):  # data from another tokenizer than the run's
        build_datasets(cfg_for(tmp_path / "b" / "small"))
    out = build_datasets(cfg_for(tmp_path / "b" / "small", "Model.vocab_size=384"), tokenizer=small)
    assert int(out["Train"][0]["tokens"].max()) < 300
