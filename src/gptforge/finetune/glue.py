"""GLUE tasks read from local TSV files (nothing is downloaded), encoded as the reference does.

Each task knows its files per split, the columns it uses and its label map. Files are read in
the GLUE distribution's layout (`glue_data/<TASK>/{train,dev,test}.tsv`, MNLI's
`dev_matched.tsv` / `dev_mismatched.tsv`); where the reference read another distribution of the
same data (CoLA's `raw/in_domain_*.tsv`, MNLI's `multinli_1.0_*.txt`, MRPC's
`msr_paraphrase_*.txt`) those file names are accepted too. Columns are found by header name
when the file has a header, so both layouts read through one table.

Encoding follows the reference's GPT tokenizer call: the two texts of a pair are tokenized
separately and concatenated with no separator, and a pair longer than `max_length` loses
tokens from its longer text first ("longest_first"). Padding happens per batch (`collate`).
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptforge.errors import ConfigError, DataError


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: where its files are, which columns feed the model, how labels map."""

    name: str
    files: dict[str, tuple[str, ...]]  # split -> candidate file names (first that exists wins)
    text_a: tuple[str | int, ...]  # column: header names (any) or a position for header-less files
    text_b: tuple[str | int, ...] | None
    label: tuple[str | int, ...]
    label_map: dict[str, int] | None = None  # None: the label column is already an int (or a float score)
    num_classes: int = 2
    metric: str = "Accuracy"  # Accuracy | Mcc | AccuracyAndF1 | PearsonAndSpearman
    headerless: tuple[str, ...] = ()  # file names without a header row
    strip: bool = False  # strip the text's spaces (the reference does for SST-2, whose lines end in one)
    aliases: tuple[str, ...] = field(default=())

    @property
    def regression(self) -> bool:
        return self.metric == "PearsonAndSpearman"

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.files)


_NLI3 = {"entailment": 0, "neutral": 1, "contradiction": 2}
_NLI2 = {"entailment": 0, "not_entailment": 1}

TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("CoLA", {"train": ("train.tsv", "raw/in_domain_train.tsv"), "dev": ("dev.tsv", "raw/in_domain_dev.tsv"),
                      "dev_ood": ("raw/out_of_domain_dev.tsv",), "test": ("test.tsv",)},
             text_a=("sentence", 3), text_b=None, label=(1,), metric="Mcc",
             headerless=("train.tsv", "dev.tsv", "in_domain_train.tsv", "in_domain_dev.tsv", "out_of_domain_dev.tsv")),
    GlueTask("SST2", {"train": ("train.tsv",), "dev": ("dev.tsv",), "test": ("test.tsv",)},
             text_a=("sentence",), text_b=None, label=("label",), strip=True, aliases=("SST-2",)),
    GlueTask("MRPC", {"train": ("train.tsv", "msr_paraphrase_train.txt"), "dev": ("dev.tsv",),
                      "test": ("test.tsv", "msr_paraphrase_test.txt")},
             text_a=("#1 String",), text_b=("#2 String",), label=("Quality",), metric="AccuracyAndF1"),
    GlueTask("QQP", {"train": ("train.tsv",), "dev": ("dev.tsv",), "test": ("test.tsv",)},
             text_a=("question1",), text_b=("question2",), label=("is_duplicate",), metric="AccuracyAndF1"),
    GlueTask("STSB", {"train": ("train.tsv",), "dev": ("dev.tsv",), "test": ("test.tsv",)},
             text_a=("sentence1",), text_b=("sentence2",), label=("score",), num_classes=1,
             metric="PearsonAndSpearman", aliases=("STS-B",)),
    GlueTask("MNLI", {"train": ("train.tsv", "multinli_1.0_train.txt"),
                      "dev_matched": ("dev_matched.tsv", "multinli_1.0_dev_matched.txt"),
                      "dev_mismatched": ("dev_mismatched.tsv", "multinli_1.0_dev_mismatched.txt"),
                      "test_matched": ("test_matched.tsv",), "test_mismatched": ("test_mismatched.tsv",)},
             text_a=("sentence1",), text_b=("sentence2",), label=("gold_label",), label_map=_NLI3, num_classes=3),
    GlueTask("QNLI", {"train": ("train.tsv",), "dev": ("dev.tsv",), "test": ("test.tsv",)},
             text_a=("question",), text_b=("sentence",), label=("label",), label_map=_NLI2),
    GlueTask("RTE", {"train": ("train.tsv",), "dev": ("dev.tsv",), "test": ("test.tsv",)},
             text_a=("sentence1",), text_b=("sentence2",), label=("label",), label_map=_NLI2),
    GlueTask("WNLI", {"train": ("train.tsv",), "dev": ("dev.tsv",), "test": ("test.tsv",)},
             text_a=("sentence1",), text_b=("sentence2",), label=("label",)),
)}
_BY_ALIAS = {k.lower(): t for t in TASKS.values() for k in (t.name, *t.aliases)}


def get_task(name: str, key: str = "Data.Train.dataset.name") -> GlueTask:
    """The task called `name` (case-insensitive; SST-2 / STS-B spellings too)."""
    task = _BY_ALIAS.get(str(name).lower())
    if task is None:
        raise ConfigError(f"{key}: {name!r} is not a GLUE task; choose one of {', '.join(TASKS)}")
    return task


def is_glue(name: str | None) -> bool:
    return name is not None and str(name).lower() in _BY_ALIAS


@dataclass
class GlueExample:
    text_a: str
    text_b: str | None
    label: float | int | None  # None: the split has no labels (GLUE test files)


def task_file(task: GlueTask, root: str | Path, split: str) -> Path:
    """The file of `split` under `root` (a file path given as root is used as it is)."""
    r = Path(root).expanduser()
    if r.is_file():
        return r
    if split not in task.files:
        raise ConfigError(f"Data.*.dataset.split: {split!r} is not a {task.name} split; choose one of "
                          f"{', '.join(task.splits)}")
    if not r.is_dir():
        raise DataError(f"{r}: {task.name} directory not found (Data.*.dataset.root); it should hold "
                        f"{task.files[split][0]}")
    for name in task.files[split]:
        if (r / name).is_file():
            return r / name
    raise DataError(f"{r}: no {task.name} {split} file ({' or '.join(task.files[split])})")


def _column(spec: tuple[str | int, ...], header: list[str] | None, path: Path, what: str) -> int:
    names = [s for s in spec if isinstance(s, str)]
    if header is not None:
        for n in names:
            if n in header:
                return header.index(n)
        raise DataError(f"{path}: header has no {what} column ({' or '.join(names)}); columns: {', '.join(header)}")
    positions = [s for s in spec if isinstance(s, int)]
    if not positions:
        raise DataError(f"{path}: expected a header row naming the {what} column ({' or '.join(names)})")
    return positions[0]


def read_glue(task: GlueTask, root: str | Path, split: str) -> list[GlueExample]:
    """The examples of one split. Rows whose label is outside the label map are skipped as the
    reference does (MNLI's unlabeled `-` rows); other malformed rows are errors naming the line."""
    path = task_file(task, root, split)
    csv.field_size_limit(sys.maxsize)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not rows:
        raise DataError(f"{path}: empty file")
    headerless = path.name in task.headerless
    header = None if headerless else [c.strip() for c in rows[0]]
    body = rows if headerless else rows[1:]
    ia = _column(task.text_a, header, path, "text")
    ib = _column(task.text_b, header, path, "second text") if task.text_b else None
    has_label = header is None or any(isinstance(s, str) and s in header for s in task.label)
    il = _column(task.label, header, path, "label") if has_label else None
    out: list[GlueExample] = []
    for lineno, row in enumerate(body, start=1 if headerless else 2):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        need = max(i for i in (ia, ib, il) if i is not None)
        if len(row) <= need:
            raise DataError(f"{path}:{lineno}: {len(row)} columns, expected at least {need + 1}")
        label = None
        if il is not None:
            raw = row[il].strip()
            if task.label_map is not None:
                if raw not in task.label_map:
                    continue
                label = task.label_map[raw]
            else:
                try:
                    label = float(raw) if task.regression else int(raw)
                except ValueError:
                    raise DataError(f"{path}:{lineno}: label {raw!r} is not "
                                    f"{'a number' if task.regression else 'an integer'}") from None
                if not task.regression and not 0 <= label < task.num_classes:
                    raise DataError(f"{path}:{lineno}: label {label} outside 0..{task.num_classes - 1}")
        a, b = row[ia], row[ib] if ib is not None else None
        out.append(GlueExample(a.strip() if task.strip else a, b, label))
    if not out:
        raise DataError(f"{path}: no {task.name} examples")
    return out


def truncate_pair(a: list[int], b: list[int] | None, max_length: int) -> tuple[list[int], list[int] | None]:
    """The reference's "longest_first": drop one token at a time from the end of the longer text
    (the second one on a tie) until both fit."""
    if b is None:
        return a[:max_length], None
    excess = len(a) + len(b) - max_length
    if excess <= 0:
        return a, b
    la, lb = len(a), len(b)
    for _ in range(excess):
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], b[:lb]


class GlueDataset(torch.utils.data.Dataset):
    """Encoded examples of one split: item = (token ids, label)."""

    def __init__(self, task: GlueTask, examples: Sequence[GlueExample], tokenizer, max_length: int):
        self.task, self.max_length = task, max_length
        self.examples = list(examples)
        a_ids = tokenizer.encode_batch([e.text_a for e in self.examples])
        b_ids = (tokenizer.encode_batch([e.text_b or "" for e in self.examples]) if task.text_b
                 else [None] * len(a_ids))
        self.ids: list[list[int]] = []
        for i, (a, b) in enumerate(zip(a_ids, b_ids, strict=True)):
            a, b = truncate_pair(a, b, max_length)
            ids = a + (b or [])
            if not ids:
                raise DataError(f"{task.name} example {i}: empty text")
            self.ids.append(ids)
        self.has_labels = all(e.label is not None for e in self.examples)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.ids[i], self.examples[i].label


def load_glue(name: str, root: str | Path, split: str, tokenizer, max_length: int,
              key: str = "Data.Train.dataset") -> GlueDataset:
    """Read and encode one split of a GLUE task."""
    if root is None:
        raise ConfigError(f"{key}.root: set the directory of the {name} TSV files")
    task = get_task(name, f"{key}.name")
    return GlueDataset(task, read_glue(task, root, split), tokenizer, max_length)


def collate(items, pad_id: int, regression: bool) -> dict[str, torch.Tensor]:
    """Right-pad a batch to its longest example with `pad_id`. Under causal attention the
    padding never reaches a real position, so the logits equal those of padding every example
    to `max_length` as the reference does."""
    longest = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), longest), pad_id, dtype=torch.long)
    for i, (seq, _) in enumerate(items):
        ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    out = {"input_ids": ids}
    if all(label is not None for _, label in items):
        out["labels"] = torch.tensor([label for _, label in items],
                                     dtype=torch.float32 if regression else torch.long)
    return out
