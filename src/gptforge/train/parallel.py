"""The parallelism seam between the trainer and torch.distributed.

`setup_parallel(model, cfg, device)` returns the model to train and a `ParallelContext` that
answers everything the trainer needs to know about other processes: its data rank and world
(for the sampler), whether it writes files, how to skip gradient sync during accumulation, how
to average a logged value, and how to get the plain model back for saving. The trainer never
imports torch.distributed; data/tensor/fully-sharded parallel wrapping lives here only.

This version is the single-process path: rank 0 of 1, the model unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from gptforge.config.loader import world_size_from_env
from gptforge.config.schema import Config
from gptforge.errors import ConfigError


@dataclass
class ParallelContext:
    """What the trainer needs to know about the process group (single process: 0 of 1)."""

    data_rank: int = 0
    data_world_size: int = 1
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """The process that writes checkpoints, logs and metrics."""
        return self.rank == 0

    def no_sync(self, model: nn.Module, last_micro_batch: bool):
        """Context for one micro-batch's backward: gradient sync only on the last one."""
        return contextlib.nullcontext()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar over data ranks (for logged losses)."""
        return value

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model (no DDP/compile wrappers) whose state_dict is saved."""
        return getattr(model, "_orig_mod", model)

    def barrier(self) -> None:
        """Wait for every rank (a no-op in one process)."""

    def close(self) -> None:
        """Tear down the process group, if this context created one."""


def setup_parallel(model: nn.Module, cfg: Config, device: torch.device) -> tuple[nn.Module, ParallelContext]:
    """(model to train, context). Only the single-process path exists so far: a run asking
    for more than one process fails here with a clear message."""
    d = cfg.Distributed
    world = world_size_from_env()
    degrees = {"dp_degree": d.dp_degree or 1, "mp_degree": d.mp_degree, "pp_degree": d.pp_degree,
               "sharding.sharding_degree": d.sharding.sharding_degree}
    wide = {k: v for k, v in degrees.items() if v > 1}
    if world > 1 or wide:
        what = ", ".join(f"Distributed.{k}={v}" for k, v in wide.items()) or f"WORLD_SIZE={world}"
        raise ConfigError(f"{what}: distributed training is not available in this build yet; "
                          "run one process with every Distributed degree at 1")
    return model, ParallelContext(device=torch.device(device))
