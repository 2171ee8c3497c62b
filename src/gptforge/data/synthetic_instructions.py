"""A synthetic instruction set with checkable answers, held-out instances and preference pairs.

    python -m gptforge.data.synthetic_instructions --out DIR [--train 4000] [--test 200] [--seed 0]

writes DIR/train.jsonl and DIR/test.jsonl (`messages` records: the user's task and the one
right answer) and DIR/pref_train.jsonl, DIR/pref_test.jsonl (`prompt` as messages, `chosen` the
right answer, `rejected` a plausible wrong answer of the same task and shape). Four tasks:

- reverse:  "Reverse: s t o n e"        → "e n o t s"
- sort:     "Sort: 4 1 3 8"             → "1 3 4 8"     (distinct digits)
- add:      "Add: 3 1 4 + 5 0 2"        → "8 1 6"       (two numbers digit by digit, no carries)
- format:   "List with commas: c a t"   → "c, a, t"

Why this spelling: a space before every character makes it a word-start token (" s"), one of
the commonest tokens of any English/code BPE, so a pretrained model already has a distinct
embedding for each (a character glued to others is a rare token whose embedding pretraining
never separated from the other rare ones). Characters whose spaced form is not one token of the
tokenizer at hand are left out of the alphabet (`single_token_chars`), so every character is
always exactly one token. Each task is then a rule over single tokens that a small model can
learn and apply to strings it never saw: the test instances are held out (no test prompt occurs
in the training set), drawn from the same lengths (3 to 6 items; 2 to 4 digits per number) and
the same per-character facts (the carry-free digit sums), but as new strings. `solve(prompt)`
computes the right answer of any prompt, so every answer is checkable; `score_answers` is exact
match of the greedy answers (per task too) and whether they ended with EOS within the token limit.

The wrong answer of a preference pair is the kind of mistake the task invites, with the same
characters so that an untuned model has no reason to prefer either: another order of the items
(reverse, sort, format), one digit of the sum off by one (add).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
LENGTHS = (3, 6)
TASKS = ("reverse", "sort", "add", "format")
PROMPTS = {"reverse": "Reverse: ", "sort": "Sort: ", "add": "Add: ", "format": "List with commas: "}


def single_token_chars(tokenizer, pool: str) -> str:
    """The characters c of `pool` whose " c" is one token of `tokenizer` (and decodes back)."""
    out = []
    for c in pool:
        ids = tokenizer.encode(" " + c)
        if len(ids) == 1 and tokenizer.decode(ids) == " " + c:
            out.append(c)
    return "".join(out)


def task_of(prompt: str) -> str:
    """The task a prompt asks for."""
    for task, head in PROMPTS.items():
        if prompt.startswith(head):
            return task
    raise ValueError(f"not a synthetic instruction: {prompt!r}")


def solve(prompt: str) -> str:
    """The one right answer of a prompt, computed from the prompt alone."""
    task = task_of(prompt)
    body = prompt[len(PROMPTS[task]):]
    if task == "add":
        a, b = (x.split() for x in body.split(" + "))
        return " ".join(str(int(x) + int(y)) for x, y in zip(a, b, strict=True))
    chars = body.split()
    if task == "reverse":
        return " ".join(chars[::-1])
    if task == "sort":
        return " ".join(sorted(chars))
    return ", ".join(chars)


def _draw(pool: str, rng: random.Random, lengths: tuple[int, int], distinct: bool = False) -> list[str]:
    """`lengths` (min, max) characters from `pool` (`distinct`: no repeats), not all the same
    (so a wrong order always exists)."""
    while True:
        n = rng.randint(lengths[0], min(lengths[1], len(pool)) if distinct else lengths[1])
        out = rng.sample(pool, n) if distinct else [rng.choice(pool) for _ in range(n)]
        if len(set(out)) > 1:
            return out


def _other_order(chars: list[str], right: list[str], rng: random.Random) -> list[str]:
    out = chars[:]
    while out == right:
        rng.shuffle(out)
    return out


def _addition(rng: random.Random, digits: str, lengths: tuple[int, int]) -> tuple[str, str, str]:
    """Two numbers whose digit sums are all single digits of the alphabet (no carries)."""
    facts = [(a, b) for a in digits for b in digits if str(int(a) + int(b)) in set(digits)]
    n = rng.randint(max(2, lengths[0] - 1), max(2, lengths[0] - 1, lengths[1] - 2))
    pairs = [rng.choice(facts) for _ in range(n)]
    prompt = f"{PROMPTS['add']}{' '.join(a for a, _ in pairs)} + {' '.join(b for _, b in pairs)}"
    right = solve(prompt).split()
    i = rng.randrange(n)
    near = [d for d in digits if abs(int(d) - int(right[i])) <= 1 and d != right[i]] or \
        [d for d in digits if d != right[i]]
    wrong = right[:i] + [rng.choice(near)] + right[i + 1:]
    return prompt, " ".join(right), " ".join(wrong)


def _instance(task: str, rng: random.Random, lengths: tuple[int, int], letters: str,
              digits: str) -> tuple[str, str, str]:
    """(prompt, right answer, a plausible wrong answer of the same shape)."""
    if task == "add":
        return _addition(rng, digits, lengths)
    chars = _draw(digits, rng, lengths, distinct=True) if task == "sort" else _draw(letters, rng, lengths)
    if task == "sort":
        chars = _other_order(chars, sorted(chars), rng)  # the prompt is never already sorted
    prompt = PROMPTS[task] + " ".join(chars)
    right = solve(prompt)
    items = right.replace(",", "").split()
    wrong = _other_order(items, items, rng)
    return prompt, right, (", " if task == "format" else " ").join(wrong)


def make_instances(n_train: int, n_test: int, seed: int = 0, lengths: tuple[int, int] = LENGTHS,
                   letters: str = LETTERS, digits: str = DIGITS) -> tuple[list[tuple], list[tuple]]:
    """Train and held-out test instances (prompt, answer, wrong answer), tasks in turn; no test
    prompt occurs among the training prompts, and the test prompts are distinct. `lengths`:
    the (min, max) items of reverse, sort and format (numbers to add: min - 1 to max - 2 digits,
    at least 2); `letters`, `digits`: the alphabets (see `single_token_chars`)."""
    rng = random.Random(seed)
    test, seen = [], set()
    while len(test) < n_test:
        inst = _instance(TASKS[len(test) % len(TASKS)], rng, lengths, letters, digits)
        if inst[0] not in seen:
            seen.add(inst[0])
            test.append(inst)
    train, tries = [], 0
    while len(train) < n_train:
        inst = _instance(TASKS[tries % len(TASKS)], rng, lengths, letters, digits)
        tries += 1
        if inst[0] not in seen:
            train.append(inst)
    return train, test


# Unlabelled text showing the four operations: no instruction words, no chat template.
SKILL_TEXT = {"reverse": "{body} backwards is {answer} .", "sort": "{body} in order is {answer} .",
              "add": "{body} = {answer} .", "format": "{body} with commas is {answer} ."}
WORD_TASKS = ("reverse", "format")  # the style preference: these answers end with a full stop
STOP = " ."


def skill_lines(seed: int = 0, lengths: tuple[int, int] = LENGTHS, letters: str = LETTERS, digits: str = DIGITS,
                exclude: set[str] | frozenset = frozenset()) -> Iterator[str]:
    """Endless lines of skill text ("s t o n e backwards is e n o t s ."), tasks in turn, for a
    pretraining mix (data/pretrain_mix.py); an instance whose prompt is in `exclude` (the
    held-out test prompts) is never written."""
    rng = random.Random(f"skills-{seed}")
    i = 0
    while True:
        task = TASKS[i % len(TASKS)]
        i += 1
        prompt, answer, _ = _instance(task, rng, lengths, letters, digits)
        if prompt not in exclude:
            yield SKILL_TEXT[task].format(body=prompt[len(PROMPTS[task]):], answer=answer)


def style_pair(prompt: str, answer: str) -> tuple[str, str]:
    """(chosen, rejected), both right: a word answer (reverse, format) ends with a full stop, a
    number answer (sort, add) does not. A model tuned on the bare answers prefers the unmarked
    side of every pair, so it starts at about half right; the preference is learnable from the
    task named in the prompt."""
    marked = answer + STOP
    return (marked, answer) if task_of(prompt) in WORD_TASKS else (answer, marked)


def messages(prompt: str, answer: str | None = None) -> list[dict]:
    out = [{"role": "user", "content": prompt}]
    return out + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def write_set(out_dir: str | Path, n_train: int = 4000, n_test: int = 200, seed: int = 0,
              lengths: tuple[int, int] = LENGTHS, tokenizer=None) -> dict[str, Path]:
    """Write the four JSONL files; returns their paths by name. With `tokenizer`, the alphabets
    keep only the characters that are one token of it when spaced."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    alpha = {} if tokenizer is None else {"letters": single_token_chars(tokenizer, LETTERS),
                                          "digits": single_token_chars(tokenizer, DIGITS)}
    train, test = make_instances(n_train, n_test, seed, lengths, **alpha)
    files = {}
    for name, rows in (("train", train), ("test", test)):
        files[name] = out / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps({"messages": messages(p, a)}) + "\n" for p, a, _ in rows))
        files[f"pref_{name}"] = out / f"pref_{name}.jsonl"
        files[f"pref_{name}"].write_text("".join(
            json.dumps({"prompt": messages(p), "chosen": a, "rejected": w}) + "\n" for p, a, w in rows))
        files[f"style_{name}"] = out / f"style_{name}.jsonl"
        files[f"style_{name}"].write_text("".join(json.dumps(
            dict(zip(("prompt", "chosen", "rejected"), (messages(p), *style_pair(p, a)), strict=True))) + "\n"
            for p, a, _ in rows))
    return files


def write_skill_mix(prefix: str | Path, tokenizer, files: dict[str, Path], fraction: float = 0.3, seed: int = 0,
                    lengths: tuple[int, int] = LENGTHS) -> dict:
    """The built-in corpus + skill text (`fraction` of the tokens; no instance of `files["test"]`,
    same alphabets as the set) as pretraining token files at `prefix` (data/pretrain_mix.py)."""
    from gptforge.data.pretrain_mix import write_mix

    test = {json.loads(line)["messages"][0]["content"] for line in Path(files["test"]).read_text().splitlines()}
    lines = skill_lines(seed, lengths, single_token_chars(tokenizer, LETTERS), single_token_chars(tokenizer, DIGITS),
                        frozenset(test))
    return write_mix(prefix, tokenizer, lines, fraction, seed=seed)


def write_skill_docs(path: str | Path, tokenizer, files: dict[str, Path], n: int, seed: int = 1,
                     lengths: tuple[int, int] = LENGTHS) -> Path:
    """`n` lines of skill text as separate documents (`prompt_completion` records with an empty
    prompt: every token learned, positions restarting per document when `gptforge sft` packs
    them), never an instance of `files["test"]`; same alphabets as the set (`tokenizer`: None keeps
    every character)."""
    test = {json.loads(line)["messages"][0]["content"] for line in Path(files["test"]).read_text().splitlines()}
    alpha = (LETTERS, DIGITS) if tokenizer is None else (single_token_chars(tokenizer, LETTERS),
                                                         single_token_chars(tokenizer, DIGITS))
    lines = skill_lines(seed, lengths, *alpha, frozenset(test))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": "", "completion": next(lines)}) + "\n" for _ in range(n)))
    return path


def score_answers(answers: list[str], finished: list[bool], expected: list[str], prompts: list[str] | None = None) -> dict:
    """Exact match (answers stripped) and the fraction that ended with EOS within the limit;
    with the prompts, the exact match of each task too (`by_task`)."""
    n = len(expected)
    hits = [a.strip() == e.strip() for a, e in zip(answers, expected, strict=True)]
    out = {"n": n, "exact_match": sum(hits) / n if n else 0.0, "ended_with_eos": sum(finished) / n if n else 0.0}
    if prompts is not None:
        by: dict[str, list[bool]] = {}
        for p, h in zip(prompts, hits, strict=True):
            by.setdefault(task_of(p), []).append(h)
        out["by_task"] = {t: sum(v) / len(v) for t, v in by.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gptforge.data.synthetic_instructions", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for train/test/pref_train/pref_test .jsonl")
    p.add_argument("--train", type=int, default=4000, help="training instances")
    p.add_argument("--test", type=int, default=200, help="held-out test instances")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", type=int, nargs=2, default=LENGTHS, metavar=("MIN", "MAX"),
                   help="items per reverse / sort / format task (default 3 6)")
    p.add_argument("--tokenizer", metavar="DIR|gpt2", help="keep only the characters that are one token of this "
                   "tokenizer when spaced (a model directory, a tokenizer directory or gpt2)")
    p.add_argument("--pretrain-mix", metavar="PREFIX", help="also write the built-in corpus mixed with skill text "
                   "(never a test instance) as token files PREFIX_ids.npy + PREFIX_idx.npz (needs --tokenizer)")
    p.add_argument("--mix-fraction", type=float, default=0.3, help="the skill text's share of the mix's tokens")
    p.add_argument("--skill-docs", type=int, default=0, metavar="N", help="also write N lines of skill text as "
                   "separate documents, OUT/skill_docs.jsonl (prompt/completion records, never a test instance)")
    args = p.parse_args(argv)
    tok = None
    if args.tokenizer:
        from gptforge.data.tokenizer import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
    elif args.pretrain_mix:
        p.error("--pretrain-mix needs --tokenizer (the tokenizer the model is pretrained with)")
    files = write_set(args.out, args.train, args.test, args.seed, tuple(args.lengths), tok)
    print(" ".join(str(f) for f in files.values()))
    if args.skill_docs:
        print(write_skill_docs(Path(args.out) / "skill_docs.jsonl", tok, files, args.skill_docs,
                               lengths=tuple(args.lengths)))
    if args.pretrain_mix:
        info = write_skill_mix(args.pretrain_mix, tok, files, args.mix_fraction, args.seed, tuple(args.lengths))
        print(f"{args.pretrain_mix}: {info['tokens']:,} tokens in {info['docs']:,} documents, skill text "
              f"{info['added_tokens']:,} tokens in {info['added_docs']:,} documents")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
