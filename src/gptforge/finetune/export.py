"""Exports of a fine-tuned classifier (`gptforge finetune`): an HF `GPT2ForSequenceClassification`
directory and an ONNX graph `input_ids [B, T] -> logits [B, num_classes]`.

Both pool the same token as our `SequenceClassifier`: the rightmost position whose id is not
the pad id. transformers computes exactly that from `config.pad_token_id`, which the HF export
sets to the classifier's pad id, so the logits in transformers equal ours. Quantized backbones
export with their weights folded to float (activations float), as `gptforge export` does for
language models.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

OPSET = 18
MODEL_FILE = "model.onnx"
META_FILE = "gptforge_export.json"


@dataclass
class ClassifierExport:
    out_dir: str
    format: str
    num_classes: int
    pad_token_id: int
    task: str | None
    source_kind: str = "float"
    files: list[str] = field(default_factory=list)
    check: dict | None = None
    seconds: float = 0.0


def _labels(task: str | None, num_classes: int) -> dict[int, str]:
    from gptforge.finetune.glue import get_task

    if task:
        t = get_task(task, "task")
        if t.label_map and len(t.label_map) == num_classes:
            return {v: k for k, v in t.label_map.items()}
    return {i: f"LABEL_{i}" for i in range(num_classes)}


def save_hf_classifier(clf: nn.Module, out_dir: str | os.PathLike, tokenizer=None, *, task: str | None = None,
                       model_cfg=None, max_shard_size: int | str | None = None,
                       overwrite: bool = False) -> ClassifierExport:
    """Write `clf` as a transformers GPT2ForSequenceClassification directory (config.json with
    num_labels, id2label, pad_token_id; `score.weight`; tokenizer files)."""
    from gptforge.export.hf import DEFAULT_MAX_SHARD_SIZE, hf_parts, parse_size, write_safetensors
    from gptforge.model_io import atomic_dir

    max_bytes = parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    hf, config, facts = hf_parts(clf.gpt, tokenizer, model_cfg)
    hf["score.weight"] = clf.score.weight.detach().float().cpu().contiguous()
    labels = _labels(task, clf.num_classes)
    config.update(
        architectures=["GPT2ForSequenceClassification"], num_labels=clf.num_classes,
        id2label={str(i): name for i, name in labels.items()}, label2id={name: i for i, name in labels.items()},
        pad_token_id=clf.pad_token_id,
        problem_type="regression" if clf.num_classes == 1 else "single_label_classification")
    if task:
        config["gptforge_task"] = task
    res = ClassifierExport(str(out_dir), "hf", clf.num_classes, clf.pad_token_id, task, facts.source_kind)
    with atomic_dir(out_dir, overwrite) as tmp:
        res.files = write_safetensors(hf, tmp, max_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        res.files.append("config.json")
        if tokenizer is not None:
            tokenizer.save(tmp)
            res.files += sorted(p.name for p in tmp.iterdir() if p.name not in res.files)
    return res


class _Plain(nn.Module):
    """The classifier over a float backbone (quantized weights folded)."""

    def __init__(self, clf: nn.Module):
        super().__init__()
        from gptforge.export.common import fold_quantization
        from gptforge.finetune.classifier import SequenceClassifier

        self.inner = SequenceClassifier(fold_quantization(clf.gpt), clf.num_classes, clf.pad_token_id)
        with torch.no_grad():
            self.inner.score.weight.copy_(clf.score.weight.float())
        self.inner.float().eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids)


def _check_inputs(pad_id: int, vocab: int, max_len: int, seed: int = 0) -> torch.Tensor:
    """A right-padded batch of random lengths (some rows full length)."""
    g = torch.Generator().manual_seed(seed)
    T = min(max_len, 24)
    ids = torch.randint(0, vocab, (4, T), generator=g)
    ids[ids == pad_id] = (pad_id + 1) % vocab
    for row, n in enumerate((T, T // 2, 3, T - 1)):
        ids[row, n:] = pad_id
    return ids


def export_onnx_classifier(clf: nn.Module, out_dir: str | os.PathLike, tokenizer=None, *, cfg=None,
                           task: str | None = None, check: bool = True, overwrite: bool = False) -> ClassifierExport:
    """Write `clf` as ONNX (opset 18, dynamic batch and length): input `input_ids` int64 [B, T],
    output `logits` float32 [B, num_classes]; checked in onnxruntime against PyTorch unless
    `check=False`. config.yaml, tokenizer files and gptforge_export.json go beside it."""
    import onnx

    from gptforge.config import config_to_yaml
    from gptforge.export.common import model_kind, quiet_exporter
    from gptforge.model_io import atomic_dir

    t0 = time.perf_counter()
    plain = _Plain(clf)
    gpt = plain.inner.gpt
    vocab, max_pos = int(gpt.wte.weight.shape[0]), int(gpt.wpe.weight.shape[0])
    example = _check_inputs(plain.inner.pad_token_id, vocab, max_pos)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", max=max_pos)
    with quiet_exporter(), torch.no_grad():
        prog = torch.onnx.export(plain, (example,), dynamo=True, opset_version=OPSET, verbose=False,
                                 input_names=["input_ids"], output_names=["logits"],
                                 dynamic_shapes={"input_ids": {0: batch, 1: seq}})
    res = ClassifierExport(str(out_dir), "onnx", clf.num_classes, clf.pad_token_id, task, model_kind(clf.gpt))
    with atomic_dir(out_dir, overwrite) as tmp:
        with quiet_exporter():
            prog.save(tmp / MODEL_FILE)
        del prog
        onnx.checker.check_model(str(tmp / MODEL_FILE), full_check=True)
        if check:
            res.check = check_onnx_classifier(tmp / MODEL_FILE, plain, vocab, max_pos)
        if cfg is not None:
            (tmp / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(tmp)
        res.seconds = round(time.perf_counter() - t0, 2)
        res.files = sorted([*(p.name for p in tmp.iterdir()), META_FILE])
        meta = {**res.__dict__, "kind": "classifier", "inputs": ["input_ids"], "outputs": ["logits"],
                "opset": OPSET}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return res


def check_onnx_classifier(path: Path, plain: nn.Module, vocab: int, max_pos: int) -> dict:
    """Max |logit difference| between onnxruntime and PyTorch on padded batches of two shapes."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    worst, agree, n = 0.0, 0, 0
    for seed in (1, 2):
        ids = _check_inputs(plain.inner.pad_token_id, vocab, max_pos, seed)[: 2 + seed]
        with torch.no_grad():
            ref = plain(ids).numpy()
        got = sess.run(["logits"], {"input_ids": ids.numpy()})[0]
        worst = max(worst, float(np.abs(got - ref).max()))
        if ref.shape[1] > 1:
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            n += len(ref)
    tol = 1e-3
    if worst > tol:
        raise RuntimeError(f"ONNX classifier logits differ from PyTorch by {worst:.3g} (> {tol})")
    return {"max_abs_diff": worst, "argmax_agreement": agree / n if n else None}
