"""`Engine.fit_to_max_time`: re-fit the run's length and its learning-rate decay to the steps that
fit in `Engine.max_time`, from the step time measured as the run goes.

Without it, a machine slower than planned stops at `max_time` with the schedule part-way (lr not
yet decayed) and a faster one ends early with time unused. With it, every logging window sets
`max_steps` to the steps that fit (more or fewer than planned) and stretches or shrinks the decay
by the same factor, so the run ends near `max_time` with its schedule completed. The warmup
stays as it was (it is over after the first windows).
"""

from __future__ import annotations

from gptforge.train.optim import LRSchedule


class TimeFit:
    """Refits `max_steps` and `schedule.decay` (in samples of `gbs`) for a run of `max_time` s."""

    def __init__(self, schedule: LRSchedule, max_steps: int, max_time: float, gbs: int, start_step: int,
                 cap: int | None = None):
        self.schedule, self.max_time, self.gbs, self.start_step = schedule, float(max_time), gbs, start_step
        self.cap = cap  # `Engine.fit_max_steps`: the most steps a fit may choose
        self.planned = max_steps
        self.reported = max_steps  # the length last logged (drift is logged once it passes 5%)
        self.decay_per_step = schedule.decay / max(max_steps * gbs, 1)  # decay_steps / max_steps as planned

    def fit(self, step: int, elapsed: float) -> int:
        """The run's new length after `step` (of which `step - start_step` took `elapsed` s in this
        run): the steps that fit in `max_time` at the measured rate, at most `cap`, never fewer
        than `step + 1`."""
        done = step - self.start_step
        if done <= 0 or elapsed <= 0:
            return self.planned
        fit = self.start_step + int(self.max_time * done / elapsed)
        if self.cap is not None:
            fit = min(fit, self.cap)
        return max(step + 1, fit)

    def apply(self, max_steps: int, step_seconds: float = 0.0) -> str | None:
        """Stretch the schedule's decay to a run of `max_steps` (keeping decay ≥ warmup). Returns
        a log line once the length has drifted more than 5% from the one last reported."""
        self.schedule.decay = max(self.decay_per_step * max_steps * self.gbs, self.schedule.warmup)
        if abs(max_steps - self.reported) <= 0.05 * self.reported:
            return None
        line = (f"[fit] Engine.fit_to_max_time: {max_steps} steps fit in {self.max_time:g} s at {step_seconds:.3f} "
                f"s/step (was {self.reported}); lr decay refitted")
        self.reported = max_steps
        return line
