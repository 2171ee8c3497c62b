"""Where a training run starts: the one place that reads `--ckpt`, `--resume`, `--force` and
`Engine.save_load.ckpt_dir` for every verb that trains (`pretrain`, `qat`, `prune`, `finetune`).

A run either *continues* a checkpoint of its own lineage (`resume`: a step checkpoint, a run
directory = its newest complete checkpoint, or `auto` = the newest one in the output directory,
nothing there = a fresh start) or *starts* a new lineage, optionally from a model's weights
(`pretrained`). A new lineage refuses an output directory holding another run's checkpoints
unless `force`, which deletes them (with the old logs) once the run owns the directory.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gptforge.errors import UsageError
from gptforge.train import checkpoint as ckpt

# What a new run into a directory replaces, besides the other runs' checkpoints.
RUN_FILES = ("metrics.jsonl", "train.log")
RUN_DIRS = ("tensorboard",)


@dataclass
class RunStart:
    """The decision: continue `resume` (lineage `run_id`) or start lineage `run_id` afresh,
    from `pretrained` weights when set. `foreign`: other runs' checkpoints in `output_dir`."""

    output_dir: Path
    resume: Path | None
    run_id: str | None
    pretrained: Path | None = None
    force: bool = False
    kinds: tuple[str, ...] = ("step",)
    foreign: list[Path] = field(default_factory=list)

    def check_lineage(self) -> None:
        """Refuse another run's checkpoints in the output directory unless `force` (call it again
        once the directory's lock is held: a run may have finished there in between)."""
        self.foreign = ckpt.foreign_checkpoints(self.output_dir, self.run_id, self.kinds)
        if self.foreign and not self.force:
            names = ", ".join(p.name for p in self.foreign[-3:])
            raise UsageError(f"{self.output_dir}: already holds checkpoints of another run ({names}); continue "
                             "that run with --resume auto, choose another Engine.save_load.output_dir (--out), or "
                             "start over there with --force (deletes them)")

    def start_over(self, extra_files: Iterable[str] = ()) -> None:
        """`force`: delete the other runs' checkpoints and the old logs (call it holding the lock)."""
        if not self.force:
            return
        for p in ckpt.foreign_checkpoints(self.output_dir, self.run_id, self.kinds):
            shutil.rmtree(p)
        for name in (*RUN_FILES, *extra_files):
            (self.output_dir / name).unlink(missing_ok=True)
        for name in RUN_DIRS:
            shutil.rmtree(self.output_dir / name, ignore_errors=True)


def _notice(msg: str, echo: bool) -> None:
    if echo:
        print(f"gptforge: {msg}", file=sys.stderr)


def find_resume(spec, output_dir: Path, kinds: tuple[str, ...] = ("step",), echo: bool = True) -> Path | None:
    """The checkpoint `spec` names: None/"" → None; "auto" → the newest complete one in
    `output_dir` (None, said once, when there is none); else a checkpoint or its run directory."""
    if spec is None or str(spec) == "":
        return None
    if str(spec) == "auto":
        latest = ckpt.latest_checkpoint(output_dir, kinds)
        if latest is None:
            _notice(f"--resume auto: no complete checkpoint in {output_dir}; starting from step 0", echo)
        return latest
    return ckpt.resolve_resume_dir(spec, kinds)


def is_training_checkpoint(path, kinds: tuple[str, ...] = ("step",)) -> bool:
    """A checkpoint with training state, or a run directory holding one (what `--ckpt` resumes)."""
    p = Path(path)
    return p.is_dir() and (ckpt.is_complete(p) or ckpt.latest_checkpoint(p, kinds) is not None)


def plan_start(cfg, *, resume=None, ckpt_path=None, force: bool = False,
               resumable: Callable[[Path], bool] | None = is_training_checkpoint,
               kinds: tuple[str, ...] = ("step",), overrides=(), echo: bool = True) -> RunStart:
    """Decide where the run of `cfg` starts.

    `resume`: --resume (auto or a checkpoint), else `Engine.save_load.ckpt_dir`; giving both is an
    error. `ckpt_path`: --ckpt; when `resumable(path)` says it is this verb's training checkpoint
    it is resumed (and cannot be combined with `resume`), otherwise it is the model whose weights
    a new run starts from (`pretrained`; `resumable=None`: always). `force`: a new run that
    deletes other runs' checkpoints; refused together with resuming. `overrides` (the -o
    strings) that change a resumed checkpoint's shape are refused rather than ignored.
    """
    from gptforge.model_io import resolve_checkpoint_path

    e = cfg.Engine.save_load
    if resume is not None and e.ckpt_dir:
        raise UsageError("give either --resume or Engine.save_load.ckpt_dir, not both")
    spec = resume if resume is not None else e.ckpt_dir
    pretrained = None
    if ckpt_path:
        if resumable is not None and resumable(Path(ckpt_path)):
            if spec:
                raise UsageError("--ckpt already names the checkpoint; drop --resume / Engine.save_load.ckpt_dir")
            spec = str(ckpt.resolve_resume_dir(ckpt_path, kinds))
        else:
            pretrained = resolve_checkpoint_path(ckpt_path)
    if force and spec:
        raise UsageError("--force starts a new run; it cannot be combined with resuming (--resume, a training "
                         "checkpoint as --ckpt, Engine.save_load.ckpt_dir)")
    output_dir = Path(e.output_dir).expanduser()
    resume_dir = find_resume(spec, output_dir, kinds, echo)
    if resume_dir is not None:
        ckpt.check_shape_overrides(overrides, cfg.Model, resume_dir)
    # Lineage: a resumed run keeps the id its checkpoint records (None: one written before ids existed).
    run_id = ckpt.run_id_of(resume_dir) if resume_dir is not None else ckpt.new_run_id()
    start = RunStart(output_dir, resume_dir, run_id, pretrained, force, kinds)
    start.check_lineage()
    return start


__all__ = ["RunStart", "find_resume", "is_training_checkpoint", "plan_start"]
