"""What the Trainer tells the user: the run's header line, trackers and a subclass's extra metrics."""

from __future__ import annotations

from gptforge.train.metrics import RunLogger, device_name


class TrainerReport:
    """Mixin of `Trainer`: header, tracker runs and extra per-record metrics."""

    def extra_metrics(self, kind: str) -> dict:
        """Metrics a subclass's loss gathered since the last "train" or "eval" record (DPO's rewards)."""
        return {}

    def _extra_line(self, log: RunLogger, kind: str) -> dict:
        extra = self.extra_metrics(kind)
        if extra:
            log.info(f"[{kind}] " + ", ".join(f"{k}: {v:.6g}" for k, v in extra.items()))
        return extra

    def _trackers(self) -> list:
        """W&B / MLflow runs for `Engine.trackers` (called by the logging process only)."""
        from gptforge.train.trackers import open_trackers

        e = self.cfg.Engine
        return open_trackers(e.trackers, self.output_dir, e.tracker_project, e.tracker_run_name, self.cfg.to_dict())

    def _header(self, log: RunLogger, start_step: int) -> None:
        cfg, m = self.cfg, self.model
        n = sum(p.numel() for p in m.parameters())
        trainable = sum(p.numel() for p in self.params)
        where = " in rank 0's pipeline stages" if self.par.pipelined else ""
        log.info(f"gptforge {self.verb}: {n / 1e6:.2f}M parameters{where} ({trainable / 1e6:.2f}M trainable), "
                 f"device {device_name(self.device)}, {self.precision.name}, global batch {self.gbs} "
                 f"(micro {cfg.Global.micro_batch_size} x {self.acc} accumulation), seq "
                 f"{cfg.Data.Train.dataset.max_seq_len}, recompute "
                 f"{cfg.Model.recompute_granularity if self.recomputed else 'off'}, output {self.output_dir}"
                 + (", glibc heap reuse on" if self.malloc_tuned else ""))
        if self.par.distributed:
            log.info(self.par.describe())
        if self.resume_dir is not None:
            log.info(f"resumed from {self.resume_dir} at step {start_step} "
                     f"({start_step * self.gbs} samples consumed)")
        if self.peak is None:
            log.info(f"MFU: n/a (no peak-FLOPs entry for {device_name(self.device)})")
