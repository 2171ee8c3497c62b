"""Run-wide decisions of the Trainer that every rank must take alike (stop, max_time, refit)."""

from __future__ import annotations

import time

import torch

from gptforge.train.time_fit import TimeFit


class TrainerSync:
    """Mixin of `Trainer`: one answer on all ranks for signals, the clock and `fit_to_max_time`."""

    def _refit(self, fit: TimeFit, elapsed: float, log) -> None:
        """`Engine.fit_to_max_time`: the run's length and lr decay from the measured rate (rank 0's)."""
        n = int(self._rank0(fit.fit(self.step, elapsed)))
        if n != self.max_steps:
            note = fit.apply(n, elapsed / (self.step - fit.start_step))
            if note:
                log.info(note)
            self.max_steps = n
            log.set_total(n)
            self.scheduler.apply()

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (a signal may reach only some of them)."""
        if self.par.world_size == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _out_of_time(self, t_start: float) -> bool:
        """`Engine.max_time` has passed (every rank takes rank 0's answer, so all stop together)."""
        limit = self.cfg.Engine.max_time
        if not limit:
            return False
        return bool(self._rank0(float(time.perf_counter() - t_start >= limit)))

    def _rank0(self, value: float) -> float:
        """Rank 0's `value` on every rank (decisions taken from one clock, so all ranks agree)."""
        if self.par.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], device=self.device, dtype=torch.float64)
        dist.broadcast(t, 0)
        return float(t.item())
