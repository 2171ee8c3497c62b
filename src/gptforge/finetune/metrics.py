"""The GLUE metrics the reference reports, from predictions and labels (numpy only).

Accuracy; Mcc (Matthews correlation, CoLA); AccuracyAndF1 (MRPC, QQP: accuracy, precision,
recall and F1 of class 1, and their "acc_and_f1" mean); PearsonAndSpearman (STS-B: both
correlations and their mean). Each returns a dict whose `main` value is the one the reference
tracks as its best metric. tests/test_finetune_metrics.py checks them against scikit-learn and
scipy on the same predictions.
"""

from __future__ import annotations

import numpy as np

from gptforge.errors import ConfigError

METRICS = ("Accuracy", "Mcc", "AccuracyAndF1", "PearsonAndSpearman")


def accuracy(pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    acc = float(np.mean(pred == label)) if len(label) else 0.0
    return {"acc": acc, "main": acc}


def mcc(pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    """Matthews correlation over any number of classes (0 when a marginal is constant)."""
    classes = np.union1d(pred, label)
    idx_p, idx_l = np.searchsorted(classes, pred), np.searchsorted(classes, label)
    c = np.zeros((len(classes), len(classes)), dtype=np.float64)
    np.add.at(c, (idx_l, idx_p), 1.0)
    t, p, n = c.sum(axis=1), c.sum(axis=0), c.sum()
    correct = np.trace(c)
    cov_yp = correct * n - t @ p
    cov_pp = n * n - p @ p
    cov_yy = n * n - t @ t
    denom = np.sqrt(cov_pp * cov_yy)
    value = float(cov_yp / denom) if denom > 0 else 0.0
    return {"mcc": value, "main": value}


def accuracy_and_f1(pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    """Binary: class 1 is positive. Precision/recall/F1 are 0 where undefined."""
    tp = float(np.sum((pred == 1) & (label == 1)))
    fp = float(np.sum((pred == 1) & (label != 1)))
    fn = float(np.sum((pred != 1) & (label == 1)))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
    acc = accuracy(pred, label)["acc"]
    return {"acc": acc, "precision": precision, "recall": recall, "f1": f1, "acc_and_f1": (acc + f1) / 2,
            "main": (acc + f1) / 2}


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denom) if denom > 0 else 0.0


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing their mean rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    start = 0
    while start < len(x):
        end = start
        while end + 1 < len(x) and xs[end + 1] == xs[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def pearson_and_spearman(pred: np.ndarray, label: np.ndarray) -> dict[str, float]:
    pred, label = np.asarray(pred, dtype=np.float64), np.asarray(label, dtype=np.float64)
    pearson = _pearson(pred, label)
    spearman = _pearson(_average_ranks(pred), _average_ranks(label))
    return {"pearson": pearson, "spearman": spearman, "corr": (pearson + spearman) / 2,
            "main": (pearson + spearman) / 2}


_FUNCS = {"Accuracy": accuracy, "Mcc": mcc, "AccuracyAndF1": accuracy_and_f1,
          "PearsonAndSpearman": pearson_and_spearman}


def check_metric(name: str, key: str = "Model.metric.eval.name") -> str:
    if name not in _FUNCS:
        raise ConfigError(f"{key}: {name!r} is not one of {', '.join(METRICS)}")
    return name


def compute(name: str, logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The metric `name` of logits [N, C] (C = 1: regression scores) against labels [N]."""
    logits = np.asarray(logits)
    preds = logits[:, 0] if logits.shape[-1] == 1 else logits.argmax(-1)
    return _FUNCS[check_metric(name)](preds, np.asarray(labels))


def describe(name: str, res: dict[str, float]) -> str:
    """The reference's eval summary for one metric, e.g. `acc: 0.91200`."""
    keys = {"Accuracy": ("acc",), "Mcc": ("mcc",), "AccuracyAndF1": ("acc", "precision", "recall", "f1", "acc_and_f1"),
            "PearsonAndSpearman": ("pearson", "spearman", "corr")}[name]
    return ", ".join(f"{k}: {res[k]:.5f}" for k in keys)
