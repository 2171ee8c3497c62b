"""The Trainer's evaluation: the mean loss over the next batches of its persistent Eval iterator."""

from __future__ import annotations

import torch

from gptforge.errors import ConfigError


class TrainerEval:
    """Mixin of `Trainer`: `evaluate()`, which resumes where the last evaluation stopped."""

    @torch.no_grad()
    def evaluate(self, iters: int | None = None) -> float:
        """Mean loss over the next `iters` (default `eval_iters`) batches of the persistent
        eval iterator; each local batch in one forward pass (spec §2.5)."""
        iters = iters or self.cfg.Engine.eval_iters
        if "Eval" not in self.datasets:
            raise ConfigError("no Eval dataset: set Data.Eval.dataset.input_dir or Engine.eval_iters=0")
        if getattr(self, "_eval_iter", None) is None:
            self._eval_iter = self._batches("Eval", self.eval_consumed)
        model = self.model
        was_training = model.training
        model.eval()
        losses = []
        try:
            for _ in range(iters):
                batch = next(self._eval_iter)
                if self.par.pipelined:
                    with self.precision.autocast():
                        losses.append(self.par.pipeline_eval(batch))
                else:
                    losses.append(self._forward_loss(batch, model).float())
                self.eval_consumed += self.gbs
                self.eval_batches_done += 1
        finally:
            model.train(was_training)
        return float(self.par.mean(torch.stack(losses).mean()))
