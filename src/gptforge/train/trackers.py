"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow (`Engine.trackers`).

Every metrics record the trainer writes to `metrics.jsonl` (kind `train`, `eval`, `summary`, ...)
goes to each tracker as `<kind>/<name>` at its step, and the resolved config goes in once as
parameters. Both work without a network by default:

- W&B runs offline (`WANDB_MODE=offline`) unless the user sets `WANDB_MODE`; the run lives under
  `<run dir>/wandb` and `wandb sync` uploads it later.
- MLflow writes a file store under `<run dir>/mlruns` unless `MLFLOW_TRACKING_URI` is set.

A resumed run continues the same tracker run: its id is kept in `<run dir>/trackers.json`.
Only the process that writes the run's logs (rank 0) opens trackers.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from gptforge.errors import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")
_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}


def check_trackers(names) -> None:
    """Unknown names and missing packages fail before any work, in one line naming the key."""
    import importlib.util

    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"Engine.trackers: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        pkg = _PACKAGES.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise ConfigError(f"Engine.trackers: {name} needs the {pkg} package: pip install 'gptforge[track]'")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _numbers(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class _Ids:
    """Tracker run ids kept in the run directory, so a resumed run continues the same one."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "trackers.json"
        try:
            self.ids = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.ids = {}

    def get(self, name: str) -> str | None:
        return self.ids.get(name)

    def put(self, name: str, run_id: str) -> None:
        self.ids[name] = run_id
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ids))
        os.replace(tmp, self.path)


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict, ids: _Ids):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")  # never reach the network unless the user asks
        os.environ.setdefault("WANDB_SILENT", "true")
        self._wandb = wandb
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config,
                              id=ids.get("wandb"), resume="allow", reinit="create_new")
        ids.put("wandb", self.run.id)

    def log(self, kind: str, step: int, values: dict) -> None:
        nums = _numbers(values)
        if nums:
            self.run.log({f"{kind}/{k}": v for k, v in nums.items()}, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)
        self._wandb.teardown()  # stop wandb's service process with the run: nothing is left behind


class MLflowTracker:
    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict, ids: _Ids):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # A file store in the run directory: no server, no database package (mlflow-skinny has
            # none). MLflow 3 keeps this backend but asks for an explicit opt-in.
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        run_id = ids.get("mlflow")
        if run_id is None:
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i:i + 100])
            ids.put("mlflow", run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, kind: str, step: int, values: dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{kind}/{k}", v, now, step) for k, v in _numbers(values).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if ok else "FAILED")


def open_trackers(names, run_dir: Path, project: str, run_name: str | None, config: dict) -> list:
    """The trackers named in `names` other than TensorBoard (the run logger writes that itself)."""
    check_trackers(names)
    ids = _Ids(run_dir)
    name = run_name or Path(run_dir).resolve().name
    out = []
    for n in names:
        if n == "wandb":
            out.append(WandbTracker(run_dir, project, name, config, ids))
        elif n == "mlflow":
            out.append(MLflowTracker(run_dir, project, name, config, ids))
    return out
