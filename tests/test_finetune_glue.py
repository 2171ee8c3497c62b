"""GLUE readers: every task's file layout, label map and columns; the reference's encoding."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from gptforge.errors import ConfigError, DataError
from gptforge.finetune.glue import TASKS, GlueDataset, collate, get_task, read_glue, truncate_pair
from test_finetune_support import NLI2, NLI3, small_tokenizer, write_split

ROWS = [("the movie was good", "it was fine", 1), ("a dull\t-free film", "x", 0)]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_each_task_reads_its_columns_and_labels(tmp_path, task):
    t = TASKS[task]
    rows = [(f"first {i} \"quoted\"", f"second {i}" if t.text_b else None,
             round(i * 0.7, 3) if t.regression else i % t.num_classes) for i in range(7)]
    split = "dev_matched" if task == "MNLI" else "dev"
    write_split(tmp_path, task, split, rows)
    got = read_glue(t, tmp_path, split)
    assert [(e.text_a, e.text_b) for e in got] == [(a, b) for a, b, _ in rows]
    if t.regression:
        assert [e.label for e in got] == pytest.approx([y for *_, y in rows])
    else:
        assert [e.label for e in got] == [y for *_, y in rows]


def test_label_maps_are_the_references():
    assert TASKS["MNLI"].label_map == {"entailment": 0, "neutral": 1, "contradiction": 2}
    assert TASKS["QNLI"].label_map == TASKS["RTE"].label_map == {"entailment": 0, "not_entailment": 1}
    assert [TASKS[k].num_classes for k in ("CoLA", "SST2", "MNLI", "STSB")] == [2, 2, 3, 1]
    assert {k: t.metric for k, t in TASKS.items()} == {
        "CoLA": "Mcc", "SST2": "Accuracy", "MRPC": "AccuracyAndF1", "QQP": "AccuracyAndF1",
        "STSB": "PearsonAndSpearman", "MNLI": "Accuracy", "QNLI": "Accuracy", "RTE": "Accuracy", "WNLI": "Accuracy"}
    assert get_task("sst-2") is TASKS["SST2"] and get_task("STS-B") is TASKS["STSB"]
    with pytest.raises(ConfigError, match="not a GLUE task"):
        get_task("IMDB")


def test_mnli_skips_unlabelled_rows_and_reads_the_multinli_layout(tmp_path):
    write_split(tmp_path, "MNLI", "train", [("a", "b", 0), ("c", "d", 2)])
    text = (tmp_path / "train.tsv").read_text().replace("\tcontradiction\tcontradiction", "\t-\t-")
    (tmp_path / "train.tsv").write_text(text)
    assert [e.text_a for e in read_glue(TASKS["MNLI"], tmp_path, "train")] == ["a"]
    # the reference read multinli_1.0_*.txt: gold_label first, sentence1/sentence2 by header
    header = ["gold_label", "sentence1_binary_parse", "sentence2_binary_parse", "sentence1_parse",
              "sentence2_parse", "sentence1", "sentence2", "promptID", "pairID", "genre"]
    rows = [[NLI3[y], "(", "(", "(", "(", f"p{y}", f"h{y}", "1", "1n", "fiction"] for y in (2, 1)]
    d = tmp_path / "multinli_1.0"
    d.mkdir()
    (d / "multinli_1.0_dev_mismatched.txt").write_text("\n".join("\t".join(r) for r in [header, *rows]) + "\n")
    got = read_glue(TASKS["MNLI"], d, "dev_mismatched")
    assert [(e.text_a, e.text_b, e.label) for e in got] == [("p2", "h2", 2), ("p1", "h1", 1)]


def test_cola_headerless_and_raw_layout(tmp_path):
    write_split(tmp_path, "CoLA", "train", [("They ran.", None, 1), ("Ran they the.", None, 0)])
    got = read_glue(TASKS["CoLA"], tmp_path, "train")
    assert [(e.text_a, e.label) for e in got] == [("They ran.", 1), ("Ran they the.", 0)]
    raw = tmp_path / "cola_public" / "raw"
    raw.mkdir(parents=True)
    (raw / "in_domain_dev.tsv").write_text("gj04\t1\t\tShe left.\ngj04\t0\t*\tLeft she the.\n")
    got = read_glue(TASKS["CoLA"], tmp_path / "cola_public", "dev")
    assert [(e.text_a, e.label) for e in got] == [("She left.", 1), ("Left she the.", 0)]


def test_test_split_without_labels(tmp_path):
    write_split(tmp_path, "RTE", "test", [("a", "b", 0), ("c", "d", 1)], labels=False)
    got = read_glue(TASKS["RTE"], tmp_path, "test")
    assert [(e.text_a, e.text_b, e.label) for e in got] == [("a", "b", None), ("c", "d", None)]
    assert not GlueDataset(TASKS["RTE"], got, small_tokenizer(), 16).has_labels


def test_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(DataError, match="SST2 directory not found"):
        read_glue(TASKS["SST2"], tmp_path / "nope", "train")
    with pytest.raises(ConfigError, match="not a SST2 split; choose one of train, dev, test"):
        read_glue(TASKS["SST2"], tmp_path, "dev_matched")
    with pytest.raises(DataError, match=r"no SST2 train file \(train.tsv\)"):
        read_glue(TASKS["SST2"], tmp_path, "train")
    (tmp_path / "train.tsv").write_text("sentence\tlabel\nfine\t1\nbroken\tyes\n")
    with pytest.raises(DataError, match=r"train.tsv:3: label 'yes' is not an integer"):
        read_glue(TASKS["SST2"], tmp_path, "train")
    (tmp_path / "train.tsv").write_text("sentence\tlabel\nfine\t1\nshort\n")
    with pytest.raises(DataError, match=r"train.tsv:3: 1 columns, expected at least 2"):
        read_glue(TASKS["SST2"], tmp_path, "train")
    (tmp_path / "train.tsv").write_text("sentence\tlabel\nfine\t3\n")
    with pytest.raises(DataError, match=r"label 3 outside 0..1"):
        read_glue(TASKS["SST2"], tmp_path, "train")
    (tmp_path / "dev.tsv").write_text("index\tquestion\tsentence\tlabel\n0\tq\ts\tentailment\n")
    with pytest.raises(DataError, match="header has no text column"):
        read_glue(TASKS["RTE"], tmp_path, "dev")


def _reference_longest_first(a, b, n):
    """The reference tokenizer's loop, step by step: remove from the end of the longer list
    (the second on a tie) until the pair fits."""
    a, b = list(a), list(b)
    for _ in range(len(a) + len(b) - n):
        if len(a) > len(b):
            a = a[:-1]
        else:
            b = b[:-1]
    return a, b


def test_truncation_is_longest_first():
    r = random.Random(0)
    for la, lb, n in itertools.product((0, 1, 5, 9), (1, 4, 9), (3, 8, 12)):
        a, b = [r.randrange(100) for _ in range(la)], [r.randrange(100) for _ in range(lb)]
        assert truncate_pair(a, b, n) == _reference_longest_first(a, b, n) if la + lb > n else (a, b)
    assert truncate_pair([1, 2, 3, 4], None, 2) == ([1, 2], None)


def test_pairs_concatenate_without_separator_and_batches_pad_right(tmp_path):
    tok = small_tokenizer()
    write_split(tmp_path, "RTE", "dev", [("the film was good.", " it was fine.", 0), ("bad.", " sad.", 1)])
    ds = GlueDataset(TASKS["RTE"], read_glue(TASKS["RTE"], tmp_path, "dev"), tok, max_length=64)
    assert ds[0][0] == tok.encode("the film was good.") + tok.encode(" it was fine.")
    b = collate([ds[0], ds[1]], pad_id=tok.eos_token_id, regression=False)
    n0, n1 = len(ds[0][0]), len(ds[1][0])
    assert b["input_ids"].shape == (2, max(n0, n1))
    assert (b["input_ids"][1, n1:] == tok.eos_token_id).all() and b["labels"].tolist() == [0, 1]
    assert collate([(ds[0][0], 2.5)], 0, regression=True)["labels"].dtype == torch.float32
    short = GlueDataset(TASKS["RTE"], read_glue(TASKS["RTE"], tmp_path, "dev"), tok, max_length=4)
    ra, rb = _reference_longest_first(tok.encode("the film was good."), tok.encode(" it was fine."), 4)
    assert short[0][0] == ra + rb and [len(ids) for ids, _ in short] == [4, 4]


def test_nli2_strings_map(tmp_path):
    write_split(tmp_path, "QNLI", "train", [("q", "s", 1), ("q2", "s2", 0)])
    assert [e.label for e in read_glue(TASKS["QNLI"], tmp_path, "train")] == [1, 0]
    assert "not_entailment" in (tmp_path / "train.tsv").read_text() and NLI2[1] == "not_entailment"
