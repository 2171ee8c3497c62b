"""The distributed half of pipeline parallel: stages on torch.distributed.pipelining, one
schedule per run, the tied-embedding gradient sum and the pieces the step needs.

Order of application on a rank (docs/distributed.md): tensor parallel on the whole GPT (its
plan names `blocks.N`), then this rank's `PipelineShare`, then FSDP2 per block and per stage
module over the sharding axis, then `PipelineStage`s and the schedule over the mesh's `pp` axis.
Only imported when pp_degree > 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gptforge.train.pipeline import (
    SCHEDULES,
    PipelineLoss,
    PipelineShare,
    rank_stages,
    stage_layers,
    stage_rank,
)


class PipelineRuntime:
    """This rank's stages, their schedule and loss, and the groups the tied embedding needs."""

    def __init__(self, ctx, gpt: nn.Module, schedule: str, virtual: int, n_micro: int, recompute_interval: int):
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        from gptforge.train import dist_env

        topo = ctx.topo
        pp, n_stages = topo.pp, topo.pp * virtual
        self.v_shape = schedule == "ZBVZeroBubble"
        self.layers = stage_layers(len(gpt.blocks), n_stages)
        stages = rank_stages(topo.pp_rank, pp, virtual, self.v_shape)
        self.share = PipelineShare(gpt, stages, self.layers, recompute_interval,
                                   ctx.mesh["mp"] if ctx.sequence_parallel else None)
        self.has_first, self.has_last = self.share.has_first, self.share.has_last
        self.first_rank, self.last_rank = 0, stage_rank(n_stages - 1, pp, self.v_shape)
        self.pp_group = ctx.mesh["pp"].get_group()
        self.pair_group = dist_env.tied_pair_group(topo, self.first_rank, self.last_rank)
        if ctx.topo.sharding > 1:
            self._fully_shard(ctx)
        self.loss = PipelineLoss(n_micro)
        self.stages = [PipelineStage(m, s, n_stages, ctx.device, group=self.pp_group)
                       for s, m in zip(stages, self.share.stages, strict=True)]
        cls = getattr(pipelining, SCHEDULES[schedule][0])
        first = self.stages if SCHEDULES[schedule][1] != 1 else self.stages[0]
        self.schedule = cls(first, n_microbatches=n_micro, loss_fn=self.loss, scale_grads=False)
        self.name, self.n_micro = schedule, n_micro
        self.pp, self.pp_rank, self.n_stages = pp, topo.pp_rank, n_stages
        self.stage_of = dict(zip(stages, self.share.stages, strict=True))
        self.hidden = gpt.config.hidden_size
        self.sp_degree = topo.mp if ctx.sequence_parallel else None

    def _fully_shard(self, ctx) -> None:
        from torch.distributed.fsdp import fully_shard

        topo, mesh = ctx.topo, ctx.mesh
        fsdp_mesh = mesh["dp", "sharding"] if topo.dp > 1 else mesh["sharding"]
        for blk in self.share.blocks.values():
            fully_shard(blk, mesh=fsdp_mesh, reshard_after_forward=ctx.sharding_stage == 3)
        for m in self.share.stages:
            # Embeddings / final norm per stage; the schedule runs FSDP's post-backward itself.
            fully_shard(m, mesh=fsdp_mesh, reshard_after_forward=False)

    # ------------------------------------------------------------------ steps

    def _inputs(self, batch: dict) -> tuple[tuple, dict, torch.Tensor | None]:
        args, kwargs = ((batch["tokens"],), {"position_ids": batch["position_ids"]}) if self.has_first else ((), {})
        target = None
        if self.has_last:
            target = torch.stack([batch["labels"].long(), batch["loss_mask"].long()], dim=-1)
        return args, kwargs, target

    def train_step(self, batch: dict) -> torch.Tensor:
        """Forward and backward of every micro-batch; the summed loss / n on the last stage's
        ranks (zero elsewhere)."""
        args, kwargs, target = self._inputs(batch)
        losses: list = []
        self.loss.eval_total = None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        return self._total(losses)

    @torch.no_grad()
    def eval_loss(self, batch: dict) -> torch.Tensor:
        """The batch's mean loss (one forward's, token-weighted) on the last stage's ranks."""
        args, kwargs, target = self._inputs(batch)
        losses: list = []
        labels, mask = batch["labels"], batch["loss_mask"]
        self.loss.eval_total = float(((labels != -100) & (mask != 0)).sum())
        try:
            if self.v_shape:
                # ZBV's action list has backward steps even in eval(): run the stages in order.
                losses = self._forward_only(batch, target)
            else:
                self.schedule.eval(*args, target=target, losses=losses, **kwargs)
        finally:
            self.loss.eval_total = None
        return self._total(losses)

    def _forward_only(self, batch: dict, target) -> list:
        """Micro-batch by micro-batch, stage by stage: activations go point to point (fp32)
        to the next stage's rank; the last stage returns its losses."""
        tokens, pos = batch["tokens"], batch["position_ids"]
        mb = tokens.shape[0] // self.n_micro
        losses = []
        for i in range(self.n_micro):
            sl = slice(i * mb, (i + 1) * mb)
            x = None
            for s in range(self.n_stages):
                if s not in self.stage_of:
                    continue
                prev = stage_rank(s - 1, self.pp, self.v_shape) if s else self.pp_rank
                if s == 0:
                    x = self.stage_of[s](tokens[sl], pos[sl])
                else:
                    if prev != self.pp_rank:
                        seq = tokens.shape[1] // (self.sp_degree or 1)
                        x = torch.empty(mb, seq, self.hidden, device=tokens.device)
                        dist.recv(x, src=dist.get_global_rank(self.pp_group, prev))
                    x = self.stage_of[s](x)
                nxt = stage_rank(s + 1, self.pp, self.v_shape) if s + 1 < self.n_stages else self.pp_rank
                if nxt != self.pp_rank:
                    dist.send(x.float().contiguous(), dst=dist.get_global_rank(self.pp_group, nxt))
            if self.has_last:
                losses.append(self.loss(x, target[sl]))
        return losses

    def _total(self, losses: list) -> torch.Tensor:
        if not self.has_last or not losses:
            return torch.zeros((), device=self.share_device())
        return torch.stack([x.detach().float() for x in losses]).sum()

    def share_device(self) -> torch.device:
        return next(self.share.parameters()).device

    def tied_weight(self) -> torch.Tensor | None:
        return self.share.wte.weight if (self.has_first or self.has_last) else None

    @torch.no_grad()
    def sync_tied_grad(self) -> None:
        """Sum the word embedding's gradient over the first and last stage (both then step alike)."""
        w = self.tied_weight()
        if self.pair_group is None or w is None or w.grad is None:
            return
        g = w.grad.to_local() if isinstance(w.grad, DTensor) else w.grad
        dist.all_reduce(g, group=self.pair_group)

    def norm_skip(self) -> set[int]:
        """Parameters whose gradient another rank already counts in the global norm: the last
        stage's copy of the tied embedding."""
        w = self.tied_weight()
        if w is not None and self.has_last and not self.has_first:
            return {id(w)}
        return set()


def loss_on_this_rank(ctx) -> bool:
    """Whether this rank's pipeline value counts in a cross-rank mean (last stage, mp rank 0)."""
    pipe = ctx._pipe
    return pipe is not None and pipe.has_last and ctx.topo.mp_rank == 0


__all__ = ["PipelineRuntime", "loss_on_this_rank"]
