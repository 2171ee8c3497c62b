"""The pretraining mix (data/pretrain_mix.py) and the synthetic set's skill text and style pairs
(data/synthetic_instructions.py): skill text never holds a held-out instance, the mix holds the
corpus documents unchanged plus the added ones in the asked share, spread over every split."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from gptforge.data.indexed import load_token_files
from gptforge.data.preprocess import preprocess_documents
from gptforge.data.pretrain_mix import write_mix
from gptforge.data.synthetic_instructions import (
    SKILL_TEXT,
    TASKS,
    main,
    make_instances,
    skill_lines,
    style_pair,
    task_of,
    write_set,
    write_skill_docs,
)
from gptforge.data.tokenizer import gpt2_tokenizer
from gptforge.errors import UsageError


def _parse(line: str) -> tuple[str, str, str]:
    """(task, question body, answer) of a skill line, read back with the templates."""
    for task, t in SKILL_TEXT.items():
        mid, tail = t.split("{answer}")[0].replace("{body}", ""), t.split("{answer}")[1]
        if mid in line and line.endswith(tail):
            body, answer = line[:-len(tail)].split(mid, 1)
            return task, body, answer
    raise AssertionError(line)


def test_skill_lines_are_right_and_never_a_held_out_instance():
    from test_synthetic_instructions import _reference_answer

    _, test = make_instances(0, 40, seed=0)
    exclude = frozenset(p for p, _, _ in test)
    bodies = {p.split(": ", 1)[1] for p in exclude}
    lines = list(itertools.islice(skill_lines(0, exclude=exclude), 4000))
    seen = [_parse(x) for x in lines]
    assert {t for t, _, _ in seen} == set(TASKS)
    heads = {"reverse": "Reverse", "sort": "Sort", "add": "Add", "format": "List with commas"}
    for task, body, answer in seen:
        assert answer == _reference_answer(f"{heads[task]}: {body}")
    # with the exclusion no held-out question appears; without it some do (so the check can fail)
    assert not bodies & {b for _, b, _ in seen}
    free = {_parse(x)[1] for x in itertools.islice(skill_lines(0), 20000)}
    assert bodies & free


def test_skill_docs_are_one_line_each_learned_whole_and_never_a_held_out_instance(tmp_path):
    from gptforge.data.packing import build_rows, encode_plain
    from test_synthetic_instructions import _reference_answer

    tok = gpt2_tokenizer()
    files = write_set(tmp_path / "set", n_train=8, n_test=40, tokenizer=tok)
    bodies = {json.loads(x)["messages"][0]["content"].split(": ", 1)[1] for x in files["test"].read_text().splitlines()}
    path = write_skill_docs(tmp_path / "docs.jsonl", tok, files, 3000)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(recs) == 3000 and all(r["prompt"] == "" and "\n" not in r["completion"] for r in recs)
    seen = [_parse(r["completion"]) for r in recs]
    heads = {"reverse": "Reverse", "sort": "Sort", "add": "Add", "format": "List with commas"}
    assert all(a == _reference_answer(f"{heads[t]}: {b}") for t, b, a in seen)
    assert {t for t, _, _ in seen} == set(TASKS) and not bodies & {b for _, b, _ in seen}
    # packed by `gptforge sft`: every document restarts at position 0 and all its tokens after the
    # first are learned (an empty prompt)
    ex = [encode_plain(tok, r["prompt"], r["completion"]) for r in recs[:12]]
    rows = build_rows(ex, 64)
    for r in range(len(rows.tokens)):
        for s in set(rows.segments[r].tolist()) - {0}:
            at = rows.segments[r] == s
            assert rows.position_ids[r][at].tolist() == list(range(int(at.sum())))
            assert rows.loss_mask[r][at].min() == 1


def test_style_pairs_mark_word_answers_with_a_full_stop(tmp_path):
    files = write_set(tmp_path, n_train=40, n_test=8)
    recs = [json.loads(x) for x in files["style_test"].read_text().splitlines()]
    assert len(recs) == 8
    for rec in recs:
        prompt = rec["prompt"][0]["content"]
        plain, marked = sorted((rec["chosen"], rec["rejected"]), key=len)
        assert marked == plain + " ."
        assert (rec["chosen"] == marked) == (task_of(prompt) in ("reverse", "format"))
    assert style_pair("Sort: 3 1 2", "1 2 3") == ("1 2 3", "1 2 3 .")


def _corpus(tmp_path, tok, n=30):
    docs = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 5) for i in range(n)]
    preprocess_documents(docs, tmp_path / "base", tok, append_eos=True, progress=False)
    return tmp_path / "base"


def test_the_mix_keeps_every_corpus_document_and_adds_the_asked_share(tmp_path):
    tok = gpt2_tokenizer()
    base = load_token_files(_corpus(tmp_path, tok))
    lines = (f"line {i} backwards is {i} ." for i in itertools.count())
    info = write_mix(tmp_path / "mix", tok, lines, fraction=0.4, per_doc=4, seed=1, base_prefix=tmp_path / "base")
    mix = load_token_files(tmp_path / "mix")
    assert info["tokens"] == len(mix.ids) == len(base.ids) + info["added_tokens"]
    assert info["docs"] == mix.n_docs == base.n_docs + info["added_docs"]
    assert 0.4 <= info["added_tokens"] / info["tokens"] < 0.5
    starts = np.concatenate([[0], np.cumsum(mix.lens)])
    docs = [tok.decode(mix.ids[a:b].tolist()) for a, b in itertools.pairwise(starts)]
    bstarts = np.concatenate([[0], np.cumsum(base.lens)])
    originals = [tok.decode(base.ids[a:b].tolist()) for a, b in itertools.pairwise(bstarts)]
    assert sorted(d for d in docs if d.startswith("document")) == sorted(originals)
    added = [d for d in docs if d.startswith("line")]
    assert "line 0 backwards is 0 .\nline 1 backwards is 1 .\nline 2 backwards is 2 .\nline 3 backwards is 3 ." \
        "<|endoftext|>" in added
    assert all(d.endswith("<|endoftext|>") and d.count("\n") == 3 for d in added)
    # interleaved: the added documents are in the first and in the last tenth of the stream
    kinds = [d.startswith("line") for d in docs]
    k = len(kinds) // 10
    assert any(kinds[:k]) and any(kinds[-k:]) and not all(kinds[:k])
    with pytest.raises(UsageError, match="fraction"):
        write_mix(tmp_path / "bad", tok, lines, fraction=1.0, base_prefix=tmp_path / "base")


def test_the_cli_writes_the_set_and_refuses_a_mix_without_a_tokenizer(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "d"), "--train", "8", "--test", "4", "--skill-docs", "10"]) == 0
    assert (tmp_path / "d" / "style_train.jsonl").is_file()
    assert len((tmp_path / "d" / "skill_docs.jsonl").read_text().splitlines()) == 10
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "d"), "--pretrain-mix", str(tmp_path / "m")])
    assert e.value.code == 2 and "--pretrain-mix needs --tokenizer" in capsys.readouterr().err
