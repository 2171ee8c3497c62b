"""The parallelism seam between the trainer and torch.distributed.

`init_parallel(cfg, device)` validates `Distributed`, joins the process group torchrun describes
(once per process: it lives until exit) and returns a `ParallelContext`; `ctx.wrap(model)`
applies the strategy from outside the model. The context answers everything the trainer needs to know about other processes: its data rank
and world (for the sampler), whether it writes files, how to skip gradient sync during
accumulation, how to clip by the global norm, how to average a logged value, and how to get
the plain model back. The trainer never imports torch.distributed.

Strategies (docs/distributed.md), on a ("dp", "pp", "sharding", "mp") device mesh:
- `pp_degree > 1`: pipeline parallel (`pipeline.py`, `parallel_pipe.py`): the rank's stages run
  through a torch.distributed.pipelining schedule (`pipeline_step`), composed with the below;
- `mp_degree > 1`: tensor parallel (DTensor plans, `parallel_tp.py`), optionally sequence parallel;
- `sharding_degree > 1`: FSDP2 `fully_shard` per block and at the root over the sharding axis
  (HSDP over dp × sharding when `dp_degree > 1` too). Stage 3 reshards the blocks'
  parameters after forward; stages 1 and 2 keep them gathered until backward ends;
- otherwise `dp_degree > 1`: DDP, or, on top of tensor parallel, one bucketed gradient
  all-reduce over the data ranks after the last micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gptforge.config.schema import Config
from gptforge.train.dist_env import Topology


@dataclass
class ParallelContext:
    """What the trainer needs to know about the process group (single process: rank 0 of 1)."""

    topo: Topology = field(default_factory=Topology)
    device: torch.device = torch.device("cpu")
    mesh: Any = None  # DeviceMesh ("dp", "pp", "sharding", "mp") when world > 1
    strategy: str = "single"  # single | ddp | fsdp | tp | tp+allreduce | tp+fsdp | pp[+tp][+fsdp|+allreduce]
    seed: int = 1024  # this rank's dropout seed (the reference's global_seed)
    sequence_parallel: bool = False
    sharding_stage: int = 2
    sharding_offload: bool = False
    data_group: Any = None  # ranks holding the same model slice (same mp rank, stage); None = WORLD
    pp_schedule: str = "1F1B"
    virtual_pp_degree: int = 1
    pp_recompute_interval: int = 0  # blocks per recompute segment in a stage; 0 = per-block recompute
    micro_batches: int = 1
    _pipe: Any = None  # PipelineRuntime when pp > 1
    ep_degree: int = 1  # expert parallel (train/parallel_ep.py): experts split over this many data ranks
    ep_mesh: Any = None  # ("edp", "ep") over the data ranks when ep_degree > 1
    _ddp: Any = None
    _fsdp_root: Any = None

    # ------------------------------------------------------------------ who am I

    @property
    def rank(self) -> int:
        return self.topo.rank

    @property
    def world_size(self) -> int:
        return self.topo.world_size

    @property
    def data_rank(self) -> int:
        return self.topo.data_rank

    @property
    def data_world_size(self) -> int:
        return self.topo.data_world_size

    @property
    def distributed(self) -> bool:
        return self.topo.world_size > 1

    @property
    def pipelined(self) -> bool:
        return self.topo.pp > 1

    @property
    def is_main(self) -> bool:
        """The process that writes checkpoints, logs and metrics."""
        return self.rank == 0

    def describe(self) -> str:
        """One log line: processes, backend and layout."""
        import torch.distributed as dist

        t = self.topo
        parts = [f"dp {t.dp}"]
        if t.pp > 1:
            parts.append(f"pp {t.pp}" + (f" x {self.virtual_pp_degree} virtual" if self.virtual_pp_degree > 1 else "")
                         + f" ({self.pp_schedule}, {self.micro_batches} micro-batches)")
        parts += [f"sharding {t.sharding}" + (f" (stage {self.sharding_stage})" if t.sharding > 1 else ""),
                  f"mp {t.mp}" + (" + sequence parallel" if self.sequence_parallel else "")]
        if self.ep_degree > 1:
            parts.append(f"ep {self.ep_degree} (experts over data ranks)")
        return (f"distributed: {t.world_size} processes ({dist.get_backend()}), {self.strategy}: "
                + " x ".join(parts) + f"; rank {t.rank} reads data slice {t.data_rank} of {t.data_world_size}")

    def record(self) -> dict:
        """The layout a checkpoint records (resume restores per-rank RNG only into the same one)."""
        return {"world_size": self.world_size, **self.topo.degrees(), "ep_degree": self.ep_degree,
                "strategy": self.strategy}

    # ------------------------------------------------------------------ wrapping

    def wrap(self, model: nn.Module) -> nn.Module:
        """Apply this context's strategy to `model` (in place where torch allows); returns the
        module to call for training steps."""
        if not self.distributed:
            return model
        from gptforge.train.parallel_wrap import wrap_model

        return wrap_model(self, model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model (no DDP/compile wrappers) whose state_dict is saved."""
        from torch.nn.parallel import DistributedDataParallel

        while True:
            if hasattr(model, "_orig_mod"):
                model = model._orig_mod
            elif isinstance(model, DistributedDataParallel):
                model = model.module
            else:
                return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Split parameter groups so each holds one kind of tensor (plain, or DTensors of one
        mesh): torch's foreach kernels refuse lists that mix them. Call before the first step."""
        if not self.distributed:
            return optimizer
        from gptforge.train.parallel_wrap import split_param_groups

        split_param_groups(optimizer)
        return optimizer

    # ------------------------------------------------------------------ per step

    def pipeline_step(self, batch: dict) -> torch.Tensor:
        """Forward + backward of the local batch through the pipeline schedule (micro-batches
        = accumulate steps); the micro-batch mean loss on last-stage ranks, 0 elsewhere (use
        `mean` for the value every rank logs)."""
        return self._pipe.train_step(batch)

    def pipeline_eval(self, batch: dict) -> torch.Tensor:
        """The local batch's mean loss through the schedule's forward (last stage; 0 elsewhere)."""
        return self._pipe.eval_loss(batch)

    def no_sync(self, model: nn.Module, last_micro_batch: bool):
        """Context for one micro-batch's backward: gradient sync only on the last one."""
        if self._ddp is not None and not last_micro_batch:
            return self._ddp.no_sync()
        if self._fsdp_root is not None:
            self._fsdp_root.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()

    def finish_backward(self, params: list[torch.Tensor]) -> None:
        """After the last micro-batch: finish the gradient reductions no wrapper did during
        backward (sequence-parallel LayerNorm gradients, tensor parallel + plain data parallel,
        the tied embedding between the first and last pipeline stage)."""
        if self.pipelined:
            from gptforge.train.parallel_wrap import allreduce_grads, reduce_partial_grads

            reduce_partial_grads(params)
            self._pipe.sync_tied_grad()
            if self.strategy.endswith("+allreduce"):
                allreduce_grads(params, self.data_group, self.data_world_size)
            return
        if self.ep_mesh is not None:
            from gptforge.train.parallel_ep import finish_expert_grads

            finish_expert_grads(self.unwrap(self._ddp or self._fsdp_root), self.ep_mesh, self.data_world_size)
        if self.strategy.startswith("tp"):
            from gptforge.train.parallel_wrap import allreduce_grads, reduce_partial_grads

            reduce_partial_grads(params)
            if self.strategy == "tp+allreduce":
                allreduce_grads(params, self.data_group, self.data_world_size)

    def clip_grad_norm_(self, params: list[torch.Tensor], clip_norm: float) -> torch.Tensor:
        """Global L2 norm over every rank's gradient shards; scales them by
        clip/max(norm, clip) when clip_norm > 0 (the reference's ClipGradByGlobalNorm)."""
        if not self.distributed:
            from gptforge.train.optim import clip_grad_norm_

            return clip_grad_norm_(params, clip_norm)
        from gptforge.train.parallel_wrap import clip_sharded_grad_norm_

        if self.pipelined:
            return clip_sharded_grad_norm_(params, clip_norm, skip=self._pipe.norm_skip(),
                                           sum_group=self._pipe.pp_group)
        return clip_sharded_grad_norm_(params, clip_norm)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a scalar over data ranks (for logged losses); under pipeline parallel the
        value of the last stage (mp rank 0) reaches every rank."""
        if self.pipelined:
            import torch.distributed as dist

            from gptforge.train.parallel_pipe import loss_on_this_rank

            v = value.detach().float().clone().to(self.device)
            if not loss_on_this_rank(self):
                v.zero_()
            dist.all_reduce(v)
            return v / self.data_world_size
        if self.data_world_size == 1:
            return value  # tensor-parallel peers already hold the same value
        import torch.distributed as dist

        v = value.detach().float().clone().to(self.device)
        dist.all_reduce(v, group=self.data_group)
        return v / self.data_world_size

    def seed_rngs(self, step: int = 0) -> None:
        """Seed the python, numpy and torch RNGs with this rank's dropout seed (plus `step`
        when a resume cannot continue the saved streams)."""
        import random

        import numpy as np

        s = self.seed + step
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)
        if self.sequence_parallel and self.device.type == "cuda":
            # Dropout on sequence shards goes through DTensor's RNG tracker, which on first use
            # would broadcast rank 0's generator to every rank (one mask for all data ranks);
            # creating it here skips that broadcast and keeps the per-rank seeds.
            from torch.distributed.tensor._random import manual_seed

            manual_seed(s, self.mesh["mp"])

    def barrier(self) -> None:
        """Wait for every rank (a no-op in one process)."""
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def gather_object(self, obj: Any) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere); [obj] in one process."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out


def init_parallel(cfg: Config, device: torch.device | str = "cpu") -> ParallelContext:
    """Validate `Distributed` against WORLD_SIZE and, under torchrun, join the process group
    and build the device mesh. One process: a context for rank 0 of 1, nothing initialised."""
    from gptforge.config.resolve import check_distributed
    from gptforge.train import dist_env

    world, rank, local_rank = dist_env.env_rank()
    check_distributed(cfg, world)
    if cfg.Distributed.pp_degree > 1:
        from gptforge.train.pipeline import check_pipeline_config

        check_pipeline_config(cfg)
    topo = dist_env.topology(cfg, world, rank, local_rank)
    device = torch.device(device)
    if world == 1:
        return ParallelContext(topo=topo, device=device, seed=cfg.Global.seed)
    device = dist_env.rank_device(device, local_rank)
    dist_env.init_process_group(cfg, device, topo)
    sh = cfg.Distributed.sharding
    from gptforge.train.pipeline import schedule_name

    m = cfg.Model
    ep = cfg.Distributed.ep_degree
    ep_mesh = None
    if ep > 1:
        from gptforge.train.parallel_ep import ep_mesh as build_ep_mesh

        ep_mesh = build_ep_mesh(topo.data_world_size, ep, device)
    return ParallelContext(topo=topo, device=device, mesh=dist_env.build_mesh(topo, device), strategy=_strategy(topo),
                           seed=dist_env.dropout_seed(cfg.Global.seed, topo),
                           sequence_parallel=m.sequence_parallel, sharding_stage=sh.sharding_stage,
                           sharding_offload=sh.sharding_offload, data_group=dist_env.data_group(topo),
                           pp_schedule=schedule_name(cfg.Distributed.pp_schedule, m.virtual_pp_degree),
                           virtual_pp_degree=m.virtual_pp_degree,
                           pp_recompute_interval=_recompute_interval(cfg), micro_batches=cfg.Engine.accumulate_steps,
                           ep_degree=ep, ep_mesh=ep_mesh)


def _recompute_interval(cfg: Config) -> int:
    """Blocks per recompute segment inside a pipeline stage: `pp_recompute_interval` with full
    recompute (the reference's PipelineLayer segments), else 0 (per-block units as without pp)."""
    m = cfg.Model
    full = (m.recompute_granularity or ("full" if m.use_recompute else None)) == "full"
    k = cfg.Distributed.pp_recompute_interval
    return k if full and k > 1 and cfg.Distributed.pp_degree > 1 else 0


def _strategy(topo: Topology) -> str:
    if topo.pp > 1:
        name = "pp" + ("+tp" if topo.mp > 1 else "")
        if topo.sharding > 1:
            return name + "+fsdp"
        return name + ("+allreduce" if topo.dp > 1 else "")
    if topo.mp > 1:
        if topo.sharding > 1:
            return "tp+fsdp"
        return "tp+allreduce" if topo.dp > 1 else "tp"
    if topo.sharding > 1:
        return "fsdp"
    return "ddp"


def setup_parallel(model: nn.Module, cfg: Config, device: torch.device | str | ParallelContext = "cpu"
                   ) -> tuple[nn.Module, ParallelContext]:
    """(model to train, context): `init_parallel` (unless a context is given) + `wrap`."""
    ctx = device if isinstance(device, ParallelContext) else init_parallel(cfg, device)
    return ctx.wrap(model), ctx


__all__ = ["ParallelContext", "init_parallel", "setup_parallel"]
