"""Knowledge distillation as a training loss option (`Engine.distill`).

    loss = (1 - alpha) * CE(student, labels) + alpha * T² * KL(softmax(teacher/T) || softmax(student/T))

averaged over the tokens the cross-entropy counts (labels != -100 and `loss_mask`), as Hinton et
al. 2015 (the T² keeps the gradient scale independent of T). The teacher is a frozen model
directory with the student's vocabulary; it runs in eval mode under `no_grad` on the same batch.
Every verb that trains through `Trainer` (pretrain, prune fine-tuning, qat) can use it: the
documented use is a small draft for speculative decoding (docs/speculative.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptforge.errors import ConfigError


def check_distill(cfg) -> None:
    """`ConfigError` naming the key for settings that cannot run."""
    d = cfg.Engine.distill
    if not d.teacher:
        return
    if not 0.0 <= d.alpha <= 1.0:
        raise ConfigError(f"Engine.distill.alpha: must be in [0, 1], got {d.alpha}")
    if d.temperature <= 0:
        raise ConfigError(f"Engine.distill.temperature: must be > 0, got {d.temperature}")
    dist = cfg.Distributed
    if (dist.mp_degree or 1) > 1 or (dist.pp_degree or 1) > 1:
        raise ConfigError("Engine.distill.teacher: distillation runs with data parallelism only; "
                          "set Distributed.mp_degree=1 and pp_degree=1")


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, weight: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """Σ weight · KL(teacher_T || student_T) over tokens ([..., V] logits, weight [...] summing to 1)."""
    V = min(student_logits.shape[-1], teacher_logits.shape[-1])
    s = F.log_softmax(student_logits[..., :V].float() / temperature, -1)
    t = F.log_softmax(teacher_logits[..., :V].float() / temperature, -1)
    kl = (t.exp() * (t - s)).sum(-1)
    return (kl * weight).sum()


class Distiller:
    """Adds the teacher term to a batch's loss (see the module docstring)."""

    def __init__(self, teacher: nn.Module, alpha: float, temperature: float):
        self.teacher = teacher.eval()
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.alpha, self.temperature = float(alpha), float(temperature)

    @classmethod
    def from_config(cls, cfg, device, student_vocab: int) -> Distiller | None:
        """The configured distiller, or None without `Engine.distill.teacher`."""
        d = cfg.Engine.distill
        if not d.teacher:
            return None
        check_distill(cfg)
        from gptforge.model_io import load_model

        teacher, tcfg = load_model(d.teacher, device=device)
        tv = int(teacher.wte.weight.shape[0])
        if tv != student_vocab:
            raise ConfigError(f"Engine.distill.teacher={d.teacher}: its vocabulary has {tv} rows, the student's "
                              f"{student_vocab}; distil from a model with the student's tokenizer and vocab_size")
        return cls(teacher, d.alpha, d.temperature)

    def loss(self, ce: torch.Tensor, student_logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """The combined loss for a batch whose cross-entropy is `ce`."""
        with torch.no_grad():
            teacher_logits = self.teacher(batch["tokens"], position_ids=batch["position_ids"]).logits
        mask = (batch["labels"] != -100).float()
        if batch.get("loss_mask") is not None:
            mask = mask * batch["loss_mask"].float()
        weight = mask / mask.sum().clamp_min(1.0)
        kl = kl_to_teacher(student_logits, teacher_logits, weight, self.temperature)
        return (1.0 - self.alpha) * ce + self.alpha * self.temperature ** 2 * kl
