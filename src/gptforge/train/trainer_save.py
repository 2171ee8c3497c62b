"""The Trainer's writes to its run directory: step checkpoints, the run's config.yaml, the lock."""

from __future__ import annotations

from pathlib import Path

from gptforge.train import checkpoint as ckpt
from gptforge.train import dist_checkpoint as dist_ckpt


class TrainerSaving:
    """Mixin of `Trainer`: saves step checkpoints (single-file or DCP) and releases the run lock."""

    def save(self, loss: float | None = None) -> Path | None:
        """Write the step checkpoint for the current step: one process writes the single-file
        format; a distributed run writes DCP shards from every rank (returns the path on rank 0)."""
        path = None
        meta = {"consumed_samples": self.step * self.gbs, "eval_consumed_samples": self.eval_consumed,
                "eval_batches": self.eval_batches_done, "global_batch_size": self.gbs,
                "scheduler_samples": self.scheduler.samples, "lr": self.scheduler.lr, "loss": loss,
                "precision": self.precision.name, "run_id": self.run_id}
        if self.par.distributed:
            path = dist_ckpt.save_distributed(self.output_dir, self.step, self.model, self.cfg, self.tokenizer,
                                              self.optimizer, self.scheduler, self.precision, meta, self.par,
                                              keep_last=self.cfg.Engine.save_load.keep_last)
            self.last_checkpoint = path
            return path if self.par.is_main else None
        if self.par.is_main:
            path = ckpt.save_checkpoint(self.output_dir, self.step, self.par.unwrap(self.model), self.cfg,
                                        self.tokenizer, self.optimizer, self.scheduler, self.precision, meta,
                                        keep_last=self.cfg.Engine.save_load.keep_last)
        self.par.barrier()
        self.last_checkpoint = path or self.output_dir / ckpt.step_dir_name(self.step)
        return path

    def _save(self, loss: float, log) -> Path | None:
        path = self.save(loss)
        if path is not None:
            log.info(f"[save] step {self.step}: {path}")
        return self.last_checkpoint

    def _write_run_config(self) -> None:
        from gptforge.config import config_to_yaml
        from gptforge.durable import write_text_durable

        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_text_durable(self.output_dir / "config.yaml", config_to_yaml(self.cfg))

    def _release(self) -> None:
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.release()
