"""A sequence-classification head over the GPT, built as the reference's GPTForSequenceClassification.

The head is one bias-free Linear(hidden → num_classes), initialised N(0, initializer_range),
applied to the final-LayerNorm hidden state of each sequence's last real token. The GPT itself
is untouched (the head reads `gpt.hidden_states`), so a pruned or fake-quant backbone
fine-tunes as it is.

Which token: the rightmost position whose id is not `pad_token_id` — what HF
`GPT2ForSequenceClassification` computes, so an exported classifier gives equal logits in
`transformers`. The reference right-pads with id 0 and takes position `count(ids != 0) - 1`;
both pick the same token unless the text itself contains the pad id (docs/finetune.md).

A classifier directory is a model directory of the backbone (any verb loads it as a GPT) plus
`classifier.safetensors`: the head weight, with the class count, pad id and task as metadata.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from gptforge.errors import CheckpointError

CLASSIFIER_FILE = "classifier.safetensors"


def last_token_index(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """[B] index of the rightmost non-pad token of each row (0 for an all-pad row)."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return (positions * (input_ids != pad_token_id).to(positions.dtype)).argmax(-1)


class SequenceClassifier(nn.Module):
    """logits [B, num_classes] = score(h[last real token]); `num_classes=1` is regression (STS-B)."""

    def __init__(self, gpt: nn.Module, num_classes: int, pad_token_id: int, init_std: float | None = None):
        super().__init__()
        self.gpt = gpt
        self.num_classes, self.pad_token_id = int(num_classes), int(pad_token_id)
        hidden = gpt.wte.weight.shape[1]
        ref = gpt.wte.weight
        self.score = nn.Linear(hidden, self.num_classes, bias=False, device=ref.device, dtype=ref.dtype)
        std = init_std if init_std is not None else gpt.config.initializer_range
        with torch.no_grad():
            nn.init.normal_(self.score.weight, 0.0, std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.gpt.hidden_states(input_ids)
        idx = last_token_index(input_ids, self.pad_token_id)
        pooled = h[torch.arange(h.shape[0], device=h.device), idx]
        return self.score(pooled)


def is_classifier_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and (p / CLASSIFIER_FILE).is_file()


def save_classifier(clf: SequenceClassifier, cfg, out_dir: str | os.PathLike, tokenizer=None, *,
                    task: str | None = None, overwrite: bool = False, extra=None) -> Path:
    """Write the backbone's model directory plus the head, atomically; `extra(tmp_dir)` adds
    files to the directory before it is published (a run's training state)."""
    from safetensors.torch import save_file

    from gptforge.model_io import atomic_dir, write_model_files

    meta = {"num_classes": str(clf.num_classes), "pad_token_id": str(clf.pad_token_id), "task": task or ""}
    with atomic_dir(out_dir, overwrite) as tmp:
        write_model_files(clf.gpt, cfg, tmp, tokenizer)
        save_file({"score.weight": clf.score.weight.detach().float().cpu().contiguous()},
                  str(tmp / CLASSIFIER_FILE), metadata=meta)
        if extra is not None:
            extra(tmp)
    return Path(out_dir)


def read_head(path: str | os.PathLike) -> tuple[torch.Tensor, dict[str, str]]:
    """(score weight [num_classes, hidden], metadata) of a classifier directory."""
    from safetensors import safe_open

    f = Path(path) / CLASSIFIER_FILE
    try:
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor("score.weight"), dict(h.metadata() or {})
    except Exception as e:  # noqa: BLE001 - safetensors raises several types
        raise CheckpointError(f"{f}: unreadable classifier head ({e})") from None


def load_classifier(path: str | os.PathLike, cfg=None, device: str | torch.device | None = None):
    """(classifier in eval mode, config, tokenizer, task name or None) from a classifier directory."""
    from gptforge.data.tokenizer import load_tokenizer
    from gptforge.model_io import load_model, resolve_checkpoint_path

    p = resolve_checkpoint_path(path)
    if not is_classifier_dir(p):
        raise CheckpointError(f"{p}: not a fine-tuned classifier (no {CLASSIFIER_FILE}); fine-tune one with "
                              "`gptforge finetune`")
    gpt, cfg = load_model(p, cfg, device=device)
    weight, meta = read_head(p)
    if weight.ndim != 2 or weight.shape[1] != gpt.wte.weight.shape[1]:
        raise CheckpointError(f"{p / CLASSIFIER_FILE}: head shape {tuple(weight.shape)} does not fit hidden size "
                              f"{gpt.wte.weight.shape[1]}")
    tok = load_tokenizer(cfg.Data.tokenizer, p)
    pad = int(meta.get("pad_token_id", tok.eos_token_id))
    clf = SequenceClassifier(gpt, weight.shape[0], pad)
    with torch.no_grad():
        clf.score.weight.copy_(weight.to(clf.score.weight.dtype))
    clf.eval()
    return clf, cfg, tok, (meta.get("task") or None)
