"""Helpers shared by the fine-tuning tests (no tests here): GLUE files written in the GLUE
distribution's layout, a small tokenizer, and a tiny pretrained-model directory."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import yaml

POS = ["good", "great", "fine", "nice", "lovely", "superb", "sweet", "bright", "happy", "warm", "rich", "clever"]
NEG = ["bad", "awful", "poor", "dull", "boring", "weak", "sad", "ugly", "cold", "bland", "grim", "messy"]
NOUNS = ["movie", "film", "story", "show", "book", "play"]

# file layout per task: header (None = header-less) and a row builder (a, b, label) -> columns
NLI3 = ["entailment", "neutral", "contradiction"]
NLI2 = ["entailment", "not_entailment"]
MNLI_HEADER = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
               "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"]
LAYOUT = {
    "CoLA": (None, lambda i, a, b, y: ["gj04", str(y), "*" if not y else "", a]),
    "SST2": (["sentence", "label"], lambda i, a, b, y: [a, str(y)]),
    "MRPC": (["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
             lambda i, a, b, y: [str(y), str(1000 + i), str(2000 + i), a, b]),
    "QQP": (["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            lambda i, a, b, y: [str(i), str(2 * i), str(2 * i + 1), a, b, str(y)]),
    "STSB": (["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2",
              "score"], lambda i, a, b, y: [str(i), "main-news", "f", "2012", str(i), "s1", "s2", a, b, f"{y:.3f}"]),
    "MNLI": (MNLI_HEADER, lambda i, a, b, y: [str(i), str(i), f"{i}n", "fiction", "(x)", "(y)", "(X)", "(Y)", a, b,
                                             NLI3[y], NLI3[y]]),
    "QNLI": (["index", "question", "sentence", "label"], lambda i, a, b, y: [str(i), a, b, NLI2[y]]),
    "RTE": (["index", "sentence1", "sentence2", "label"], lambda i, a, b, y: [str(i), a, b, NLI2[y]]),
    "WNLI": (["index", "sentence1", "sentence2", "label"], lambda i, a, b, y: [str(i), a, b, str(y)]),
}
FILES = {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv", "dev_matched": "dev_matched.tsv",
         "dev_mismatched": "dev_mismatched.tsv"}


def write_split(root: Path, task: str, split: str, rows: list[tuple], labels: bool = True) -> Path:
    """One GLUE file: rows of (text_a, text_b, label) in `task`'s column layout."""
    header, build = LAYOUT[task]
    root.mkdir(parents=True, exist_ok=True)
    lines = [] if header is None else ["\t".join(header)]
    for i, (a, b, y) in enumerate(rows):
        cols = build(i, a, b, y)
        if not labels and header is not None:  # GLUE test files: no label column
            keep = [k for k, h in enumerate(header) if h not in ("label", "gold_label", "label1", "score",
                                                                 "is_duplicate", "Quality")]
            cols = [cols[k] for k in keep]
        lines.append("\t".join(cols))
    if not labels and header is not None:
        lines[0] = "\t".join(h for h in header if h not in ("label", "gold_label", "label1", "score",
                                                            "is_duplicate", "Quality"))
    path = root / FILES[split]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def sentiment_rows(n: int, seed: int, words: tuple[list[str], list[str]] = (POS[:4], NEG[:4])) -> list[tuple]:
    """SST-2-like sentences whose label is the sentiment of one adjective."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        y = r.randint(0, 1)
        adj = r.choice(words[0] if y else words[1])
        out.append((f"the {r.choice(NOUNS)} was {adj} and {r.choice(['long', 'short', 'new', 'old'])}", None, y))
    return out


def pair_rows(n: int, seed: int, classes: int = 2) -> list[tuple]:
    """Sentence pairs whose label is how the second adjective relates to the first (same
    sentiment: 0, unrelated noun: 1, opposite: 2), so every pair task is learnable."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        y = r.randrange(classes)
        pos = r.random() < 0.5
        a_adj = r.choice(POS if pos else NEG)
        same, other = (POS, NEG) if pos else (NEG, POS)
        b_adj = r.choice(same if y == 0 else other if y == classes - 1 else NOUNS)
        out.append((f"the {r.choice(NOUNS)} was {a_adj}.", f" it was {b_adj}.", y))
    return out


def score_rows(n: int, seed: int) -> list[tuple]:
    """STS-B-like pairs with a similarity score in [0, 5] that depends on the adjectives."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = r.choice(POS + NEG), r.choice(POS + NEG)
        s = 5.0 if a == b else 3.0 if (a in POS) == (b in POS) else 0.5
        out.append((f"the film was {a}.", f" the show was {b}.", s + r.uniform(-0.4, 0.4)))
    return out


@functools.lru_cache(maxsize=1)
def small_tokenizer():
    """A byte-level BPE that holds each test word as one token (a few hundred ids)."""
    from gptforge.data.tokenizer import train_tokenizer

    words = POS + NEG + NOUNS + ["the", "was", "and", "long", "short", "new", "old", "it", "a", "treat", "mess",
                                 "show", "film"]
    text = [" ".join(f"{w} {w} the {w}." for w in words)] * 30
    return train_tokenizer(text, vocab_size=384, min_frequency=2, show_progress=False)


def tiny_model_dir(path: Path, *overrides: str, seed: int = 0) -> Path:
    """A randomly initialised tiny GPT saved as our model directory with `small_tokenizer`."""
    import torch

    from gptforge.config import load_config
    from gptforge.model import build_model
    from gptforge.model_io import save_model_dir

    cfg = load_config(overrides=["Model.hidden_size=32", "Model.num_layers=2", "Model.num_attention_heads=4",
                                 "Model.ffn_hidden_size=64", "Model.vocab_size=384", "Model.max_position_embeddings=64",
                                 *overrides])
    torch.manual_seed(seed)
    save_model_dir(build_model(cfg.Model), cfg, path, small_tokenizer(), overwrite=True)
    return path


def finetune_yaml(path: Path, task: str, root: Path, pretrained: Path, out: Path, **engine) -> Path:
    """A fine-tuning recipe in the reference's layout (finetune_gpt_345M_single_card_glue.yaml's keys)."""
    doc = {
        "Global": {"device": "cpu", "seed": 7, "global_batch_size": None, "local_batch_size": 8, "micro_batch_size": 8},
        "Engine": {"run_mode": "epoch", "max_steps": -1, "num_train_epochs": 2, "accumulate_steps": None,
                   "logging_freq": 1, "eval_freq": 1, "eval_iters": -1, "test_iters": -1,
                   "mix_precision": {"enable": False},
                   "save_load": {"save_steps": -1, "save_epoch": 1, "output_dir": str(out), "ckpt_dir": None}},
        "Model": {"module": "GPTFinetuneModule", "name": "GPT", "num_classes": None, "pretrained": str(pretrained),
                  "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                  "loss": {"train": {"name": "CrossEntropyLoss"}, "eval": {"name": "CrossEntropyLoss"}},
                  "metric": {"eval": {"name": "Accuracy"}}},
        "Optimizer": {"name": "AdamW", "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-6,
                      "lr": {"name": "LinearDecayWithWarmup", "warmup": 0.1, "max_lr": 1e-2}},
        "Data": {s: {"dataset": {"name": task, "root": str(root), "split": sp, "max_length": 32},
                     "sampler": {"name": "DistributedBatchSampler", "batch_size": 8, "shuffle": s == "Train",
                                 "drop_last": s == "Train"},
                     "loader": {"num_workers": 0, "return_list": False}}
                 for s, sp in (("Train", "train"), ("Eval", "dev"))},
    }
    for k, v in engine.items():
        doc["Engine"][k] = v
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path
