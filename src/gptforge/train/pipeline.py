"""Pipeline parallel (`Distributed.pp_degree > 1`) on torch.distributed.pipelining, from outside the model.

The GPT is cut by layer counts into `pp_degree · virtual_pp_degree` stages: the first holds the
word and position embeddings, the last the final LayerNorm and the tied output projection (the
word embedding again), every stage a run of consecutive blocks. A rank holds its stages inside
one `PipelineShare` whose parameter names are the GPT's (`wte.weight`, `blocks.5.linear1.weight`,
...), so optimizer groups, DCP checkpoints and resumes across layouts treat it like the whole
model with parts missing. The stage modules (`StageModule`) only reference the share's modules.

The tied word embedding lives on the first and the last stage; after every backward its
gradient is summed over that pair of ranks (the reference's `SharedLayerDesc`), so both copies
take the same AdamW step and stay equal. Micro-batches are the accumulate steps; the loss
function divides by their count, so gradients equal the micro-batch loop's `loss / acc`.
"""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from gptforge.errors import ConfigError

# schedule name → (torch class name, virtual stages per rank it needs: 1, or None = >1, or 2 = exactly 2)
SCHEDULES = {
    "GPipe": ("ScheduleGPipe", 1),
    "1F1B": ("Schedule1F1B", 1),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", None),
    "LoopedBFS": ("ScheduleLoopedBFS", None),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", None),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2),
}


def schedule_name(pp_schedule: str | None, virtual: int) -> str:
    """`Distributed.pp_schedule`, or its default: 1F1B, Interleaved1F1B with virtual stages."""
    if not pp_schedule:
        return "Interleaved1F1B" if virtual > 1 else "1F1B"
    for name in SCHEDULES:
        if name.lower() == pp_schedule.lower():
            return name
    raise ConfigError(f"Distributed.pp_schedule: {pp_schedule!r} is not one of {', '.join(SCHEDULES)}")


def check_schedule(name: str, virtual: int, micro_batches: int, pp: int) -> None:
    """One-line errors for schedule / virtual-stage / micro-batch combinations torch refuses."""
    need = SCHEDULES[name][1]
    if need == 1 and virtual != 1:
        raise ConfigError(f"Model.virtual_pp_degree: {virtual} needs a multi-stage schedule (Distributed.pp_schedule="
                          f"Interleaved1F1B, LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble), not {name}")
    if need is None and virtual < 2:
        raise ConfigError(f"Distributed.pp_schedule: {name} runs several stages per rank; set "
                          "Model.virtual_pp_degree=2 (or more)")
    if need == 2 and virtual != 2:
        raise ConfigError(f"Model.virtual_pp_degree: {name} runs exactly 2 stages per rank (a V), got {virtual}")
    if name == "1F1B" and micro_batches < pp:
        raise ConfigError(f"Global.micro_batch_size: 1F1B needs at least Distributed.pp_degree ({pp}) micro-batches "
                          f"per step, got {micro_batches} accumulate steps; lower the micro batch size (or use GPipe)")
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and micro_batches % pp:
        raise ConfigError(f"Global.micro_batch_size: {name} needs the accumulate steps ({micro_batches}) to be a "
                          f"multiple of Distributed.pp_degree {pp}; change the micro batch size")


def check_pipeline_config(cfg) -> None:
    """Pipeline-parallel combinations gptforge runs (docs/distributed.md, pipeline parallel)."""
    d, m = cfg.Distributed, cfg.Model
    if m.virtual_pp_degree < 1:
        raise ConfigError(f"Model.virtual_pp_degree: must be >= 1, got {m.virtual_pp_degree}")
    if d.pp_recompute_interval < 0:
        raise ConfigError(f"Distributed.pp_recompute_interval: must be >= 0, got {d.pp_recompute_interval}")
    name = schedule_name(d.pp_schedule, m.virtual_pp_degree)
    stage_layers(m.num_layers, d.pp_degree * m.virtual_pp_degree)
    check_schedule(name, m.virtual_pp_degree, cfg.Engine.accumulate_steps, d.pp_degree)
    mp = cfg.Engine.mix_precision
    if mp.enable and mp.dtype == "float16":
        raise ConfigError("Engine.mix_precision.dtype: float16 with Distributed.pp_degree > 1 needs a loss scaler "
                          "that sees every stage's gradients; use bfloat16 (no loss scaling)")
    if name == "ZBVZeroBubble" and d.sharding.sharding_degree > 1:
        raise ConfigError("Distributed.pp_schedule: ZBVZeroBubble puts the first and last stage (both holding the "
                          "tied embedding) on one rank, which FSDP2 cannot shard twice; use Interleaved1F1B with "
                          "sharding")


def stage_layers(num_layers: int, n_stages: int) -> list[range]:
    """Consecutive block ranges per stage by layer count (earlier stages take the remainder)."""
    if num_layers < n_stages:
        raise ConfigError(f"Distributed.pp_degree: {n_stages} pipeline stages (pp_degree x virtual_pp_degree) need "
                          f"at least as many layers, Model.num_layers is {num_layers}")
    base, extra = divmod(num_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_rank(stage: int, pp: int, v_shape: bool) -> int:
    """The pipeline rank that runs `stage`: round-robin (loop), or a V (ZBV: 0..p-1, then back)."""
    if v_shape:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def rank_stages(pp_rank: int, pp: int, virtual: int, v_shape: bool) -> list[int]:
    """The stage indices `pp_rank` runs, ascending."""
    return [s for s in range(pp * virtual) if stage_rank(s, pp, v_shape) == pp_rank]


class StageModule(nn.Module):
    """One pipeline stage: (tokens, position ids) → hidden on the first, hidden → hidden in
    between, hidden → logits on the last (tied projection with `wte`)."""

    def __init__(self, share: PipelineShare, stage: int, layers: range, n_stages: int, recompute_interval: int,
                 sp_mesh=None):
        super().__init__()
        # Sequence parallel: activations cross stage boundaries as this rank's sequence shard.
        self.sp_mesh = sp_mesh
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        if self.is_first or self.is_last:
            self.wte = share.wte
        if self.is_first:
            self.wpe, self.drop = share.wpe, share.drop
        self.blocks = nn.ModuleList(share.blocks[str(i)] for i in layers)
        if self.is_last:
            self.norm = share.norm
        self.recompute_interval = recompute_interval

    def _run_blocks(self, x, lo: int, hi: int):
        for blk in self.blocks[lo:hi]:
            x = blk(x, None, True, None)  # all four: the SP input plan of blocks.0 names each
        return x

    def forward(self, x, position_ids=None):
        if self.is_first:
            x = self.drop(self.wte(x) + self.wpe(position_ids))
        elif self.sp_mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            x = DTensor.from_local(x, self.sp_mesh, [Shard(1)], run_check=False)
        n, k = len(self.blocks), self.recompute_interval
        if k > 0 and self.training and x.requires_grad:
            # pp_recompute_interval: k consecutive blocks recomputed as one segment.
            for lo in range(0, n, k):
                x = checkpoint(self._run_blocks, x, lo, min(n, lo + k), use_reentrant=False)
        else:
            x = self._run_blocks(x, 0, n)
        if self.is_last:
            x = F.linear(self.norm(x), self.wte.weight)
        elif self.sp_mesh is not None:
            x = x.to_local()
        return x


class PipelineShare(nn.Module):
    """The modules of a GPT that one pipeline rank runs, under the GPT's own names; its
    `stages` are the StageModules (not registered: their parameters are these)."""

    def __init__(self, gpt: nn.Module, stages: list[int], layers: list[range], recompute_interval: int = 0,
                 sp_mesh=None):
        super().__init__()
        self.config = gpt.config
        n_stages = len(layers)
        self.has_first, self.has_last = 0 in stages, n_stages - 1 in stages
        if self.has_first or self.has_last:
            self.wte = gpt.wte
        if self.has_first:
            self.wpe, self.drop = gpt.wpe, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for s in stages for i in layers[s]})
        if self.has_last:
            self.norm = gpt.norm
        self.stage_ids = list(stages)
        self.__dict__["stages"] = [StageModule(self, s, layers[s], n_stages, recompute_interval, sp_mesh)
                                   for s in stages]

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self.stages:
            m.train(mode)
        return self

    def forward(self, *args, **kwargs):  # pragma: no cover - stages run through the schedule
        raise RuntimeError("a pipeline share runs through its schedule (ParallelContext.pipeline_step)")


class PipelineLoss:
    """The last stage's loss per micro-batch: training divides each micro-batch mean by the
    micro-batch count (the loop's loss / acc); evaluation weights it by its share of the batch's
    counted tokens, so the sum over micro-batches is the whole batch's mean (one forward's)."""

    def __init__(self, n_micro: int):
        self.n_micro = n_micro
        self.eval_total: float | None = None  # counted tokens of the whole eval batch

    def __call__(self, logits, target):
        from gptforge.model.gpt import lm_loss

        labels, mask = target[..., 0], target[..., 1]
        loss = lm_loss(logits, labels, mask)
        if self.eval_total is None:
            return loss / self.n_micro
        count = ((labels != -100) & (mask != 0)).sum().clamp_min(1)
        return loss * count / max(self.eval_total, 1.0)


__all__ = ["SCHEDULES", "PipelineLoss", "PipelineShare", "StageModule", "check_pipeline_config", "check_schedule", "rank_stages",
           "schedule_name", "stage_layers", "stage_rank"]
