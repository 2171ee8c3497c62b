"""A fine-tuning run's directory, as `pretrain` keeps its own (docs/reliability.md): every saved
`epoch_N` / `step_N` classifier directory also holds the training state (optimizer, schedule,
loss scale, RNG, the evaluations so far and the run's lineage id), so `--resume` continues it
exactly; SIGINT / SIGTERM save the step the run is on; the results file is published atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

from gptforge.errors import ConfigError

KINDS = ("step", "epoch")  # the checkpoint names a finetune run writes
RESULTS_FILE = "finetune_results.json"


def save(run, name: str, epoch: int) -> Path:
    """`run.output_dir/name`: the classifier directory plus the state to resume from this step."""
    from gptforge.finetune.classifier import save_classifier
    from gptforge.train.checkpoint import write_training_state

    path = run.output_dir / name
    for row in run.result.evals:  # the evaluation of this step is the one this directory holds
        if row["step"] == run.step:
            row["checkpoint"] = str(path)
    best = run.result.evals.index(run.result.best) if run.result.best is not None else None
    meta = {"run_id": run.start.run_id, "epoch": epoch, "batch_size": run.bs, "task": run.task.name,
            "loss": run.result.losses[-1] if run.result.losses else None, "lr": run.scheduler.lr,
            "evals": run.result.evals, "best_index": best}

    def state(tmp: Path) -> None:
        write_training_state(tmp, run.step, run.optimizer, run.scheduler, run.precision, meta)

    return save_classifier(run.clf, run.cfg, path, run.tok, task=run.task.name, overwrite=True, extra=state)


def restore(run, path: Path) -> None:
    """Continue from the checkpoint `path`: optimizer, schedule, scaler and RNG state, the step and
    the evaluations (the weights were loaded when the classifier was built from it)."""
    from gptforge.train.checkpoint import load_training_state

    meta = load_training_state(path, run.optimizer, run.scheduler, run.precision)
    if int(meta.get("batch_size", run.bs)) != run.bs:
        raise ConfigError(f"Data.Train.sampler.batch_size: {run.bs} differs from the checkpoint's "
                          f"{meta['batch_size']} ({path}); resume with the same batch size")
    run.step = run.saved_step = int(meta["step"])
    run.result.evals = list(meta.get("evals") or [])
    best = meta.get("best_index")
    run.result.best = run.result.evals[best] if best is not None else None
    run.result.losses = []  # this process's steps only, as pretrain's TrainResult
    run.result.checkpoint_dir = path


def interrupt(run, signum: int, epoch: int) -> None:
    """SIGINT/SIGTERM arrived: save the current step (unless it was just saved) and raise."""
    from gptforge.train.interrupt import stop_run

    if run.step > 0 and run.saved_step != run.step:
        run.save(f"step_{run.step}", epoch)
    stop_run(signum, run.step, run.result.checkpoint_dir if run.step > 0 else None, run.log)


def write_results(run) -> None:
    """finetune_results.json: every evaluation, the best one (and the directory holding it), the last save."""
    from gptforge.durable import write_text_durable

    r = run.result
    doc = {"task": r.task, "metric": run.metric, "epochs": r.epochs, "steps": r.steps,
           "final_loss": r.losses[-1] if r.losses else None, "evals": r.evals, "best": r.best,
           "best_checkpoint": (r.best or {}).get("checkpoint"),
           "checkpoint": str(r.checkpoint_dir) if r.checkpoint_dir else None}
    write_text_durable(run.output_dir / RESULTS_FILE, json.dumps(doc, indent=2) + "\n")


__all__ = ["KINDS", "RESULTS_FILE", "interrupt", "restore", "save", "write_results"]
