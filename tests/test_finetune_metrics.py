"""GLUE metrics against scikit-learn and scipy on the same predictions."""

from __future__ import annotations

import numpy as np
import pytest

from gptforge.errors import ConfigError
from gptforge.finetune import metrics as M

sk = pytest.importorskip("sklearn.metrics")
stats = pytest.importorskip("scipy.stats")


def _preds(rng, n, classes, quality):
    label = rng.integers(0, classes, n)
    pred = np.where(rng.random(n) < quality, label, rng.integers(0, classes, n))
    return pred, label


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("classes", [2, 3])
def test_accuracy_and_mcc(seed, classes):
    pred, label = _preds(np.random.default_rng(seed), 257, classes, 0.3 + 0.15 * seed)
    assert M.accuracy(pred, label)["acc"] == pytest.approx(sk.accuracy_score(label, pred), abs=1e-12)
    assert M.mcc(pred, label)["mcc"] == pytest.approx(sk.matthews_corrcoef(label, pred), abs=1e-12)


@pytest.mark.filterwarnings("ignore:A single label was found")
def test_mcc_degenerate_cases_match_sklearn():
    for pred, label in (([1, 1, 1], [0, 1, 1]), ([0, 0], [0, 0]), ([0, 1, 0, 1], [1, 0, 1, 0])):
        assert M.mcc(np.array(pred), np.array(label))["mcc"] == pytest.approx(
            sk.matthews_corrcoef(label, pred), abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_accuracy_and_f1(seed):
    pred, label = _preds(np.random.default_rng(10 + seed), 311, 2, 0.2 * seed)
    r = M.accuracy_and_f1(pred, label)
    assert r["f1"] == pytest.approx(sk.f1_score(label, pred), abs=1e-12)
    assert r["precision"] == pytest.approx(sk.precision_score(label, pred, zero_division=0), abs=1e-12)
    assert r["recall"] == pytest.approx(sk.recall_score(label, pred, zero_division=0), abs=1e-12)
    assert r["acc_and_f1"] == pytest.approx((sk.accuracy_score(label, pred) + sk.f1_score(label, pred)) / 2)
    none = M.accuracy_and_f1(np.zeros(4, int), np.array([0, 1, 0, 1]))
    assert none["f1"] == sk.f1_score([0, 1, 0, 1], [0, 0, 0, 0], zero_division=0) == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_pearson_and_spearman_with_ties(seed):
    rng = np.random.default_rng(20 + seed)
    label = np.round(rng.random(200) * 5, 1)  # STS-B scores: many ties
    pred = np.round(label + rng.normal(0, 0.5 + seed, 200), seed % 2)
    r = M.pearson_and_spearman(pred, label)
    assert r["pearson"] == pytest.approx(stats.pearsonr(pred, label)[0], abs=1e-10)
    assert r["spearman"] == pytest.approx(stats.spearmanr(pred, label)[0], abs=1e-10)
    assert r["corr"] == pytest.approx((r["pearson"] + r["spearman"]) / 2)


def test_compute_takes_logits():
    logits = np.array([[0.1, 0.9], [2.0, -1.0], [0.0, 3.0]])
    assert M.compute("Accuracy", logits, np.array([1, 0, 0]))["acc"] == pytest.approx(2 / 3)
    r = M.compute("PearsonAndSpearman", np.array([[1.0], [2.0], [3.5]]), np.array([1.0, 2.0, 3.0]))
    assert r["spearman"] == pytest.approx(1.0)
    assert M.describe("Mcc", {"mcc": 0.5}) == "mcc: 0.50000"
    with pytest.raises(ConfigError, match="Model.metric.eval.name: 'F1' is not one of"):
        M.compute("F1", logits, np.array([1, 0, 0]))
