"""A synthetic instruction set with checkable answers, held-out instances and preference pairs.

    python -m gptforge.data.synthetic_instructions --out DIR [--train 3000] [--test 200] [--seed 0]

writes DIR/train.jsonl and DIR/test.jsonl (`messages` records: the user's task and the one
right answer) and DIR/pref_train.jsonl, DIR/pref_test.jsonl (`prompt` as messages, `chosen` the
right answer, `rejected` a wrong answer of the same shape). Tasks, written with spaced
characters so that every letter or digit is its own GPT-2 token:

- reverse:  "Reverse: s t o n e"        → "e n o t s"
- sort:     "Sort: 4 1 3 9"             → "1 3 4 9"
- add:      "Add: 3 + 5"                → "8"
- format:   "List with commas: c a t"   → "c, a, t"

Test instances are held out: no test prompt occurs in the training set (an addition is held
out in one order, its commuted twin may be trained on). The evaluation (`score_answers`) is
exact match of the greedy answer, and whether it ended with EOS within the token limit.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
TASKS = ("reverse", "sort", "add", "format")


def _spaced(chars) -> str:
    return " ".join(chars)


def _distinct(pool: str, rng: random.Random) -> list[str]:
    """3 to 6 characters from `pool`, not all the same (so a wrong order always exists)."""
    while True:
        out = [rng.choice(pool) for _ in range(rng.randint(3, 6))]
        if len(set(out)) > 1:
            return out


def _other_order(chars: list[str], right: list[str], rng: random.Random) -> list[str]:
    out = chars[:]
    while out == right:
        rng.shuffle(out)
    return out


def _instance(task: str, rng: random.Random) -> tuple[str, str, str]:
    """(prompt, right answer, a wrong answer of the same shape)."""
    if task == "reverse":
        w = _distinct(LETTERS, rng)
        return f"Reverse: {_spaced(w)}", _spaced(w[::-1]), _spaced(_other_order(w, w[::-1], rng))
    if task == "sort":
        d = _other_order(_distinct("0123456789", rng), [], rng)
        d = _other_order(d, sorted(d), rng)  # the prompt is never already sorted
        return f"Sort: {_spaced(d)}", _spaced(sorted(d)), _spaced(_other_order(d, sorted(d), rng))
    if task == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        wrong = rng.choice([s for s in range(19) if s != a + b])
        return f"Add: {a} + {b}", str(a + b), str(wrong)
    w = _distinct(LETTERS, rng)
    return f"List with commas: {_spaced(w)}", ", ".join(w), " ; ".join(w)


def make_instances(n_train: int, n_test: int, seed: int = 0) -> tuple[list[tuple], list[tuple]]:
    """Train and held-out test instances (prompt, answer, wrong answer), tasks in turn."""
    rng = random.Random(seed)
    test, seen = [], set()
    while len(test) < n_test:
        inst = _instance(TASKS[len(test) % len(TASKS)], rng)
        if inst[0] not in seen:
            seen.add(inst[0])
            test.append(inst)
    train, tries = [], 0
    while len(train) < n_train:
        inst = _instance(TASKS[tries % len(TASKS)], rng)
        tries += 1
        if inst[0] not in seen:
            train.append(inst)
    return train, test


def messages(prompt: str, answer: str | None = None) -> list[dict]:
    out = [{"role": "user", "content": prompt}]
    return out + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def write_set(out_dir: str | Path, n_train: int = 3000, n_test: int = 200, seed: int = 0) -> dict[str, Path]:
    """Write the four JSONL files; returns their paths by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = make_instances(n_train, n_test, seed)
    files = {}
    for name, rows in (("train", train), ("test", test)):
        files[name] = out / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"messages": messages(p, a)}) + "\n" for p, a, _ in rows))
        files[f"pref_{name}"] = out / f"pref_{name}.jsonl"
        files[f"pref_{name}"].write_text("".join(
            json.dumps({"prompt": messages(p), "chosen": a, "rejected": w}) + "\n" for p, a, w in rows))
    return files


def score_answers(answers: list[str], finished: list[bool], expected: list[str]) -> dict:
    """Exact match (answers stripped) and the fraction that ended with EOS within the limit."""
    n = len(expected)
    exact = sum(a.strip() == e.strip() for a, e in zip(answers, expected, strict=True))
    return {"n": n, "exact_match": exact / n if n else 0.0, "ended_with_eos": sum(finished) / n if n else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gptforge.data.synthetic_instructions", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for train/test/pref_train/pref_test .jsonl")
    p.add_argument("--train", type=int, default=3000, help="training instances")
    p.add_argument("--test", type=int, default=200, help="held-out test instances")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    files = write_set(args.out, args.train, args.test, args.seed)
    print(" ".join(str(f) for f in files.values()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
