"""Classifier predictions over a GLUE split and the task metric on them."""

from __future__ import annotations

import contextlib
from functools import partial

import numpy as np
import torch

from gptforge.finetune import metrics
from gptforge.finetune.glue import GlueDataset, collate


def batches(ds: GlueDataset, batch_size: int, pad_id: int, *, shuffle: bool = False, drop_last: bool = False,
            seed: int = 0):
    """A DataLoader over `ds` (a private generator: shuffling never draws from the global RNG)."""
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                                       generator=g, num_workers=0,
                                       collate_fn=partial(collate, pad_id=pad_id, regression=ds.task.regression))


@torch.no_grad()
def predict_logits(clf: torch.nn.Module, ds: GlueDataset, batch_size: int, autocast=None) -> np.ndarray:
    """Logits [N, num_classes] in fp32, in dataset order."""
    was = clf.training
    clf.eval()
    device = next(clf.parameters()).device
    out = []
    try:
        for b in batches(ds, batch_size, clf.pad_token_id):
            with autocast() if autocast is not None else contextlib.nullcontext():
                out.append(clf(b["input_ids"].to(device)).float().cpu())
    finally:
        clf.train(was)
    return torch.cat(out).numpy()


def labels_of(ds: GlueDataset) -> np.ndarray:
    return np.asarray([e.label for e in ds.examples], dtype=np.float64 if ds.task.regression else np.int64)


def score(clf: torch.nn.Module, ds: GlueDataset, metric: str, batch_size: int, autocast=None) -> dict[str, float]:
    """The metric `metric` of `clf` on a labelled split, plus the mean loss and the count."""
    logits = predict_logits(clf, ds, batch_size, autocast)
    labels = labels_of(ds)
    res = metrics.compute(metric, logits, labels)
    t_logits, t_labels = torch.from_numpy(logits), torch.from_numpy(labels)
    if ds.task.regression:
        loss = torch.nn.functional.mse_loss(t_logits[:, 0].double(), t_labels.double())
    else:
        loss = torch.nn.functional.cross_entropy(t_logits.double(), t_labels)
    return {**res, "loss": float(loss), "examples": len(ds)}
