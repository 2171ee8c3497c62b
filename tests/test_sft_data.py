"""Instruction data: every format read into the same conversation, one-line errors naming
file:line and the field, validation splits, and the synthetic generator's held-out instances."""

from __future__ import annotations

import json

import pytest

from gptforge.data.instructions import read_records, split_records
from gptforge.data.synthetic_instructions import make_instances, score_answers, write_set
from gptforge.errors import ConfigError, DataError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort: 3 1\n\n(digits)"},
        {"role": "assistant", "content": "1 3"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_format_gives_the_same_conversation(tmp_path):
    alpaca = _jsonl(tmp_path / "a.jsonl", [{"system": "Be brief.", "instruction": "Sort: 3 1", "input": "(digits)",
                                           "output": "1 3"}])
    messages = _jsonl(tmp_path / "m.jsonl", [{"messages": CHAT}])
    share = tmp_path / "s.json"  # a JSON array file
    share.write_text(json.dumps([{"conversations": [{"from": "system", "value": "Be brief."},
                                                    {"from": "human", "value": "Sort: 3 1\n\n(digits)"},
                                                    {"from": "gpt", "value": "1 3"}]}]))
    for f in (alpaca, messages, share):
        (rec,) = read_records(f)
        assert rec.messages == CHAT, f
    (pc,) = read_records(_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q: 1+1\nA:", "completion": " 2"}]))
    assert (pc.prompt, pc.completion, pc.messages) == ("Q: 1+1\nA:", " 2", None)
    pref = _jsonl(tmp_path / "d.jsonl", [{"prompt": "Q", "chosen": "good", "rejected": "bad"},
                                         {"prompt": [{"role": "user", "content": "Q"}],
                                          "chosen": [{"role": "assistant", "content": "good"}], "rejected": "bad"}])
    a, b = read_records(pref, preference=True)
    assert (a.prompt, a.chosen, a.rejected) == ("Q", "good", "bad")
    assert b.prompt == [{"role": "user", "content": "Q"}] and b.chosen == "good"


@pytest.mark.parametrize("rows,fmt,message", [
    ([{"instruction": "x", "output": "y"}, {"instruction": "x", "output": None}], "auto", ":2: field 'output'"),
    ([{"messages": [{"role": "robot", "content": "x"}]}], "auto", ":1: field 'messages': messages[0].role"),
    ([{"messages": [{"role": "user", "content": "x"}]}], "auto", ":1: field 'messages' has no assistant turn"),
    ([{"conversations": [{"from": "bot", "value": "x"}]}], "auto", ":1: conversations[0].from is 'bot'"),
    ([{"prompt": "p"}], "prompt_completion", ":1: field 'completion' must be a string (it is missing)"),
    ([{"text": "p"}], "auto", ":1: no known fields"),
    ([["a"]], "auto", ":1: a record must be a JSON object"),
    ([{"prompt": "p", "chosen": "a", "rejected": "b"}], "auto", "train on it with `gptforge dpo`"),
])
def test_bad_records_name_file_line_and_field(tmp_path, rows, fmt, message):
    f = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as e:
        read_records(f, fmt)
    assert str(f) in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_file_level_errors(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "x", "output": "y"}\n{not json\n')
    with pytest.raises(DataError, match=r"broken.jsonl:2: not valid JSON"):
        read_records(broken)
    with pytest.raises(DataError, match="file not found"):
        read_records(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError, match="Instruct.format"):
        read_records(broken, "csv")
    with pytest.raises(ConfigError, match="Instruct.train_data"):
        read_records([])
    with pytest.raises(DataError, match="needs fields 'prompt', 'chosen' and 'rejected'"):
        read_records(_jsonl(tmp_path / "x.jsonl", [{"messages": CHAT}]), preference=True)


def test_validation_split_by_fraction_is_seeded_and_disjoint(tmp_path):
    f = _jsonl(tmp_path / "m.jsonl", [{"instruction": f"i{k}", "output": "o"} for k in range(40)])
    recs = read_records(f)
    train, held = split_records(recs, 0.1, seed=1)
    assert len(held) == 4 and len(train) == 36
    assert {r.where for r in train}.isdisjoint({r.where for r in held})
    assert [r.where for r in split_records(recs, 0.1, seed=1)[1]] == [r.where for r in held]
    assert split_records(recs, 0.0, 1) == (recs, [])
    with pytest.raises(ConfigError, match="eval_fraction"):
        split_records(recs, 1.0, 1)


def test_synthetic_set_holds_out_test_prompts(tmp_path):
    train, test = make_instances(400, 40, seed=3)
    assert {p for p, _, _ in test}.isdisjoint({p for p, _, _ in train})
    assert all(a != w for _, a, w in train + test)
    by_task = {p.split(":")[0] for p, _, _ in test}
    assert by_task == {"Reverse", "Sort", "Add", "List with commas"}
    files = write_set(tmp_path, 20, 8)
    assert len(read_records(files["train"])) == 20 and len(read_records(files["pref_test"], preference=True)) == 8
    s = score_answers([" e n o t s", "1 2"], [True, False], ["e n o t s", "1 3"])
    assert s == {"n": 2, "exact_match": 0.5, "ended_with_eos": 0.5}
