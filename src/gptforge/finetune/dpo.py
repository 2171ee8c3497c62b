"""`gptforge dpo`: Direct Preference Optimization on prompt / chosen / rejected pairs (docs/sft.md).

loss = −(1−ε)·log σ(β·Δ) − ε·log σ(−β·Δ),  Δ = (log π(c) − log π(r)) − (log π_ref(c) − log π_ref(r))

with sequence log-probabilities summed over the response tokens and EOS (the prompt is not
scored), β = Instruct.beta and ε = Instruct.label_smoothing (conservative DPO); equal to TRL's
`sigmoid` loss (tests/test_sft_dpo.py). At step 0 the policy is the reference, Δ = 0 and the
loss is ln 2.

The reference is the model before tuning. Its log-probabilities do not change during the run,
so they are computed once, before the first step, with the starting weights (for LoRA: the base,
adapters off) and kept per pair: the run holds no second copy of the weights. The run itself
is pretraining's `Trainer` with this loss; it logs the rewards β·(log π − log π_ref) of the
chosen and rejected answers, their margin and the reward accuracy (chosen reward > rejected).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gptforge.config.schema import Config
from gptforge.data.chat_template import Encoded
from gptforge.data.instructions import Record
from gptforge.data.packing import IGNORE, encode_plain
from gptforge.errors import DataError
from gptforge.finetune.sft import (
    Base,
    apply_method,
    check_instruct,
    load_base,
    plan_steps,
    records,
    row_length,
    save_outputs,
)
from gptforge.train.trainer import Trainer, TrainResult

SIDES = ("chosen", "rejected")


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
             ref_rejected_logps: torch.Tensor, beta: float, label_smoothing: float = 0.0):
    """Per-pair DPO losses and the (detached) chosen and rejected rewards."""
    delta = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
    losses = -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    return (losses, beta * (chosen_logps - ref_chosen_logps).detach(),
            beta * (rejected_logps - ref_rejected_logps).detach())


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ over masked positions of log p(label) → [B] (fp32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask.float()).sum(-1)


def _response(ids: list[int], mask: list[int], prompt: list[int]) -> Encoded:
    """Only the response (after the prompt's tokens) is scored, even if the template learns
    earlier assistant turns."""
    k = 0
    while k < min(len(ids), len(prompt)) and ids[k] == prompt[k]:
        k += 1
    return Encoded(ids, [0] * k + mask[k:])


def encode_pair(rec: Record, base: Base, train_on_inputs: bool = False) -> tuple[Encoded, Encoded]:
    """(chosen, rejected) ids + scored-token masks for one preference record."""
    tok = base.tokenizer
    if isinstance(rec.prompt, str):
        return (encode_plain(tok, rec.prompt, rec.chosen, train_on_inputs),
                encode_plain(tok, rec.prompt, rec.rejected, train_on_inputs))
    prompt = base.template.prompt_ids(tok, rec.prompt)
    out = []
    for answer in (rec.chosen, rec.rejected):
        enc = base.template.encode(tok, [*rec.prompt, {"role": "assistant", "content": answer}])
        out.append(_response(enc.ids, enc.mask, prompt))
    return out[0], out[1]


@dataclass
class PairRows:
    """Preference pairs as [N, seq_len] arrays per side; `index` finds the pair's reference log-probs."""

    arrays: dict[str, np.ndarray]
    dropped: int

    def __len__(self) -> int:
        return int(self.arrays["index"].shape[0])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.arrays.items()}


def build_pairs(pairs: list[tuple[Encoded, Encoded]], seq_len: int, first_index: int = 0) -> PairRows:
    """One padded row per side per pair; pairs with a side longer than a row are dropped."""
    kept = [p for p in pairs if all(2 <= len(e.ids) <= seq_len + 1 for e in p)]
    n = len(kept)
    arrays: dict[str, np.ndarray] = {"index": np.arange(first_index, first_index + n, dtype=np.int64)}
    for s, side in enumerate(SIDES):
        tokens, labels = np.zeros((n, seq_len), np.int64), np.full((n, seq_len), IGNORE, np.int64)
        mask = np.zeros((n, seq_len), np.int64)
        for r, pair in enumerate(kept):
            e = pair[s]
            k = len(e.ids) - 1
            tokens[r, :k], labels[r, :k], mask[r, :k] = e.ids[:-1], e.ids[1:], e.mask[1:]
        arrays.update({f"{side}_tokens": tokens, f"{side}_labels": labels, f"{side}_mask": mask})
    return PairRows(arrays, len(pairs) - n)


def pair_logps(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence log-probs of `model` for a batch of pair rows (one forward)."""
    tokens = torch.cat([batch["chosen_tokens"], batch["rejected_tokens"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    mask = torch.cat([batch["chosen_mask"], batch["rejected_mask"]])
    logps = sequence_logps(model(tokens).logits, labels, mask)
    return logps.chunk(2)


@torch.no_grad()
def reference_logps(model: nn.Module, rows: list[PairRows], batch_size: int, device) -> torch.Tensor:
    """[pairs, 2] log-probs of the model as it is now (the reference), by `index`."""
    total = max((int(r.arrays["index"].max()) + 1 for r in rows if len(r)), default=0)
    out = torch.zeros(total, 2, dtype=torch.float32)
    was = model.training
    model.eval()
    try:
        for r in rows:
            for i in range(0, len(r), batch_size):
                b = {k: torch.as_tensor(v[i:i + batch_size]).to(device) for k, v in r.arrays.items()}
                c, j = pair_logps(model, b)
                out[b["index"].cpu()] = torch.stack([c, j], dim=1).float().cpu()
    finally:
        model.train(was)
    return out


def preference_accuracy(model: nn.Module, rows: PairRows, ref: torch.Tensor, beta: float, batch_size: int = 16,
                        device="cpu") -> dict:
    """Held-out preference metrics: how often the model's log-prob of the chosen answer beats the
    rejected one's (`accuracy`), and how often the chosen reward beats the rejected (`reward_accuracy`)."""
    base = int(rows.arrays["index"][0]) if len(rows) else 0
    # the model's own log-probs, by the code path of the reference's
    pol = reference_logps(model, [rows], batch_size, device)[base:base + len(rows)]
    r = ref[base:base + len(rows)]
    chosen_r, rejected_r = beta * (pol[:, 0] - r[:, 0]), beta * (pol[:, 1] - r[:, 1])
    return {"pairs": len(rows), "accuracy": float((pol[:, 0] > pol[:, 1]).float().mean()),
            "reward_accuracy": float((chosen_r > rejected_r).float().mean()),
            "margin": float((chosen_r - rejected_r).mean())}


class DPOTrainer(Trainer):
    """The pretraining loop with the DPO loss over precomputed reference log-probs."""

    ref: torch.Tensor
    beta: float
    label_smoothing: float

    def _forward_loss(self, batch: dict, model: nn.Module):
        with self.precision.autocast():
            chosen, rejected = pair_logps(model, batch)
        ref = self.ref[batch["index"].cpu()].to(chosen.device)
        losses, cr, rr = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], self.beta, self.label_smoothing)
        w = self._window.setdefault("train" if model.training else "eval", [])
        w.append(torch.stack([cr.mean(), rr.mean(), (cr > rr).float().mean()]).cpu())
        return losses.mean()

    def extra_metrics(self, kind: str) -> dict:
        w = self._window.pop(kind, None)
        if not w:
            return {}
        c, r, acc = torch.stack(w).mean(0).tolist()
        return {"rewards_chosen": c, "rewards_rejected": r, "rewards_margin": c - r, "reward_accuracy": acc}


def dpo(cfg: Config, pretrained: str | os.PathLike | None = None, *, resume=None, progress: bool | None = None,
        echo: bool = True, overwrite: bool = False) -> tuple[TrainResult, dict]:
    """DPO-tune the model at `pretrained` on `cfg.Instruct.train_data` (preference pairs). Returns the
    run's result and the held-out preference metrics before and after (when there is validation data)."""
    check_instruct(cfg)
    base = load_base(cfg, pretrained)
    cfg = base.cfg
    n = row_length(cfg, base.model)
    train_recs, eval_recs = records(cfg, preference=True)
    ins = cfg.Instruct
    train = build_pairs([encode_pair(r, base, ins.train_on_inputs) for r in train_recs], n)
    evals = build_pairs([encode_pair(r, base, ins.train_on_inputs) for r in eval_recs], n, len(train)) \
        if eval_recs else None
    if len(train) == 0:
        raise DataError(f"Instruct.train_data: every pair is longer than Data.Train.dataset.max_seq_len {n} tokens")
    plan_steps(cfg, len(train), len(evals) if evals is not None else 0)
    bs = cfg.Global.micro_batch_size or 8
    device = base.model.wte.weight.device
    ref = reference_logps(base.model, [train] + ([evals] if evals is not None else []), bs, device)
    report = {}
    if evals is not None:
        report["before"] = preference_accuracy(base.model, evals, ref, ins.beta, bs, device)
    if echo:
        print(f"gptforge dpo: {len(train)} pairs ({train.dropped} too long dropped), {cfg.Engine.max_steps} steps, "
              f"beta {ins.beta}, label smoothing {ins.label_smoothing}; reference log-probs computed once",
              flush=True)
    apply_method(cfg, base, echo)  # after the reference: LoRA's reference is the base, adapters off
    trainer = DPOTrainer(cfg, base.model, base.tokenizer, datasets={"Train": train, **({"Eval": evals} if evals else {})},
                         resume=resume, progress=progress, echo=echo, overwrite=overwrite, verb="dpo")
    trainer.ref, trainer.beta, trainer.label_smoothing, trainer._window = ref, ins.beta, ins.label_smoothing, {}
    result = trainer.train()
    adapter = save_outputs(cfg, base, trainer)
    if adapter is not None:
        result.metrics["adapter"] = str(adapter)
    if evals is not None:
        report["after"] = preference_accuracy(trainer.model, evals, ref, ins.beta, bs, trainer.device)
    return result, report
