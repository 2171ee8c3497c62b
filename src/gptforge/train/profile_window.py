"""`Profiler.enable`: a torch.profiler trace of a window of training steps."""

from __future__ import annotations

from pathlib import Path

import torch

from gptforge.config.schema import Config
from gptforge.errors import ConfigError
from gptforge.train.metrics import RunLogger


class ProfileWindow:
    """`Profiler.enable`: a torch.profiler trace of steps [start, end) (`Profiler.scheduler`),
    written as a Chrome trace plus an op table under `output_dir/<profiler_log>/`."""

    def __init__(self, cfg: Config, output_dir: Path, device: torch.device, log: RunLogger):
        p = cfg.Profiler
        if len(p.scheduler) != 2 or not 0 < p.scheduler[0] < p.scheduler[1]:
            raise ConfigError(f"Profiler.scheduler: expected [start_step, end_step) with 0 < start < end, "
                              f"got {p.scheduler}")
        self.start, self.end = p.scheduler
        self.detailed, self.log = p.detailed, log
        self.dir = output_dir / p.profiler_log
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = None

    def before(self, step: int) -> None:
        if step == self.start:
            self.prof = torch.profiler.profile(activities=self.activities, record_shapes=self.detailed,
                                               with_stack=self.detailed, profile_memory=self.detailed)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        if self.prof is not None and step == self.end - 1:
            self.prof.__exit__(None, None, None)
            self.dir.mkdir(parents=True, exist_ok=True)
            name = f"steps_{self.start}-{self.end - 1}"
            self.prof.export_chrome_trace(str(self.dir / f"{name}.trace.json"))
            sort = "self_cuda_time_total" if len(self.activities) > 1 else "self_cpu_time_total"
            table = self.prof.key_averages(group_by_input_shape=self.detailed).table(sort_by=sort, row_limit=40)
            (self.dir / f"{name}.txt").write_text(table + "\n", encoding="utf-8")
            self.log.info(f"[profile] steps {self.start}..{self.end - 1}: {self.dir / name}.trace.json and .txt")
            self.prof = None
