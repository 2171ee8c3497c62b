"""The synthetic instruction set: held-out instances never trained on, answers checkable by an
independent solver, one token per character, and preference pairs whose rejected answer is wrong
but of the same task and shape."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from gptforge.data.synthetic_instructions import (
    TASKS,
    main,
    make_instances,
    score_answers,
    single_token_chars,
    task_of,
    write_set,
)


def _reference_answer(prompt: str) -> str:
    """An answer computed here with no code of the module."""
    head, body = prompt.split(": ", 1)
    if head == "Add":
        a, b = (int(x.replace(" ", "")) for x in body.split(" + "))
        width = len(body.split(" + ")[0].split())
        return " ".join(str(a + b).zfill(width))  # carry-free: the digits of the sum, zero-padded
    chars = body.split(" ")
    out = {"Reverse": chars[::-1], "Sort": sorted(chars), "List with commas": chars}[head]
    return (", " if head.startswith("List") else " ").join(out)


def test_held_out_instances_are_never_trained_on_and_answers_check(tmp_path):
    files = write_set(tmp_path, n_train=2000, n_test=200, seed=3)
    train = [json.loads(x)["messages"] for x in files["train"].read_text().splitlines()]
    test = [json.loads(x)["messages"] for x in files["test"].read_text().splitlines()]
    assert len(train) == 2000 and len(test) == 200
    train_prompts = {m[0]["content"] for m in train}
    test_prompts = [m[0]["content"] for m in test]
    assert not train_prompts & set(test_prompts) and len(set(test_prompts)) == 200
    assert Counter(task_of(p) for p in test_prompts) == {t: 50 for t in TASKS}
    for conv in train + test:
        assert conv[1]["content"] == _reference_answer(conv[0]["content"]), conv
    for split in ("pref_train", "pref_test"):
        for rec in map(json.loads, files[split].read_text().splitlines()):
            prompt = rec["prompt"][0]["content"]
            assert rec["chosen"] == _reference_answer(prompt) != rec["rejected"]
            assert len(rec["rejected"]) == len(rec["chosen"])
            if task_of(prompt) != "add":  # the same characters in another order
                assert sorted(rec["rejected"]) == sorted(rec["chosen"])
    # every test instance's facts were trained: its characters, and for addition its digit sums
    def facts(p):
        a, b = p[len("Add: "):].split(" + ")
        return set(zip(a.split(), b.split(), strict=True))

    seen = set().union(*(facts(p) for p in train_prompts if task_of(p) == "add"))
    assert all(facts(p) <= seen for p in test_prompts if task_of(p) == "add")
    assert make_instances(50, 10, seed=3) == make_instances(50, 10, seed=3)


def test_every_character_is_one_token_of_the_tokenizer(tmp_path):
    from gptforge.data.chat_template import ChatTemplate
    from gptforge.data.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer()
    assert single_token_chars(tok, "abc0123456789") == "abc0123456789"
    # a tokenizer that splits " q" and " 7": the alphabets leave them out
    files = write_set(tmp_path, 400, 40, tokenizer=_Splitting(tok, {" q", " 7"}))
    text = files["train"].read_text() + files["test"].read_text()
    assert "q" not in text.replace("equ", "") and "7" not in text
    for line in files["train"].read_text().splitlines()[:100]:
        prompt, answer = (m["content"] for m in json.loads(line)["messages"])
        ids = ChatTemplate().encode(tok, [{"role": "user", "content": prompt},
                                          {"role": "assistant", "content": answer}]).ids
        pieces = [tok.decode([i]) for i in ids]
        for item in answer.replace(",", "").split():
            assert " " + item in pieces, (answer, pieces)


class _Splitting:
    """GPT-2's tokenizer, but the strings in `split` become two tokens."""

    def __init__(self, tok, split):
        self.tok, self.split = tok, split

    def encode(self, s):
        return [0, 1] if s in self.split else self.tok.encode(s)

    def decode(self, ids):
        return self.tok.decode(ids)


def test_scores_per_task_and_the_script(tmp_path):
    prompts = ["Reverse: a b c", "Sort: 3 1 2", "Sort: 2 1 3"]
    got = score_answers(["c b a", " 1 2 3 ", "2 1 3"], [True, True, False], ["c b a", "1 2 3", "1 2 3"], prompts)
    assert got["exact_match"] == pytest.approx(2 / 3) and got["ended_with_eos"] == pytest.approx(2 / 3)
    assert got["by_task"] == {"reverse": 1.0, "sort": 0.5}
    assert main(["--out", str(tmp_path), "--train", "8", "--test", "4", "--tokenizer", "gpt2"]) == 0
    assert len((tmp_path / "pref_test.jsonl").read_text().splitlines()) == 4
    with pytest.raises(ValueError, match="not a synthetic instruction"):
        task_of("Translate: x")
