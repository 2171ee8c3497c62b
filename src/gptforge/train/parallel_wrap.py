"""The distributed half of `ParallelContext`: wrapping the model (TP → FSDP2 / DDP), optimizer
groups that foreach kernels accept, gradient averaging and clipping over sharded gradients.

Only imported when WORLD_SIZE > 1, so single-process runs never load torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gptforge.errors import ConfigError
from gptforge.model.gpt import block_linears


def wrap_model(ctx, model: nn.Module) -> nn.Module:
    """Apply `ctx.strategy` to `model`; returns the module the training step calls."""
    topo, mesh = ctx.topo, ctx.mesh
    if topo.mp > 1:
        from gptforge.train.parallel_tp import apply_tensor_parallel

        check_tp_modules(model)
        apply_tensor_parallel(model, mesh["mp"], ctx.sequence_parallel)
    if topo.pp > 1:
        return _pipeline(ctx, model)
    if topo.sharding > 1:
        return _fully_shard(ctx, model)
    if topo.dp > 1 and topo.mp == 1:
        from torch.nn.parallel import DistributedDataParallel

        if ctx.ep_mesh is not None:
            from gptforge.train.parallel_ep import apply_expert_parallel

            # Expert shards differ per rank: DDP must neither broadcast nor average them.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, apply_expert_parallel(model, ctx.ep_mesh))
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # DDP broadcasts the parameters from rank 0 here and all-reduces gradients in buckets
        # during backward.
        ctx._ddp = DistributedDataParallel(model, device_ids=ids)
        return ctx._ddp
    if topo.dp > 1:
        # Tensor parallel + plain data parallel: start every data rank from the same weights,
        # as DDP would; gradients are averaged in `finish_backward`.
        for p in model.parameters():
            dist.broadcast(_local(p.data), src=topo.mp_rank, group=ctx.data_group)
    return model


def _pipeline(ctx, model: nn.Module) -> nn.Module:
    """This rank's pipeline stages (FSDP2 inside when sharding); returns its `PipelineShare`,
    the module whose parameters the optimizer steps and the checkpoint saves."""
    from gptforge.train.parallel_pipe import PipelineRuntime

    ctx._pipe = PipelineRuntime(ctx, model, ctx.pp_schedule, ctx.virtual_pp_degree, ctx.micro_batches,
                                ctx.pp_recompute_interval)
    share = ctx._pipe.share
    if ctx.strategy.endswith("+allreduce"):
        # Plain data parallel across pipelines: start every replica of a stage from the same
        # weights, as DDP would; gradients are averaged in `finish_backward`.
        src = dist.get_process_group_ranks(ctx.data_group)[0] if ctx.data_group is not None else 0
        for p in share.parameters():
            dist.broadcast(_local(p.data), src=src, group=ctx.data_group)
    return share


def _fully_shard(ctx, model: nn.Module) -> nn.Module:
    """FSDP2 over the sharding axis (HSDP over dp × sharding when both are > 1): each block
    is one unit that all-gathers its parameters for forward and reduce-scatters its
    gradients; the root unit holds the embeddings and the final LayerNorm."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    topo, mesh = ctx.topo, ctx.mesh
    fsdp_mesh = mesh["dp", "sharding"] if topo.dp > 1 else mesh["sharding"]
    offload = CPUOffloadPolicy() if ctx.sharding_offload and ctx.device.type == "cuda" else OffloadPolicy()
    # Stage 3 frees each block's gathered parameters after its forward and gathers them again
    # for backward; stages 1/2 keep them until backward is done (one all-gather per step).
    per_block = ctx.sharding_stage == 3
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=per_block, offload_policy=offload)
    # The root's parameters (embeddings, final norm) are used first in backward: keep them.
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=False, offload_policy=offload)
    ctx._fsdp_root = model
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _mesh_key(p: torch.Tensor):
    if not isinstance(p, DTensor):
        return None
    m = p.device_mesh
    return (m.mesh_dim_names, tuple(m.mesh.flatten().tolist()))


def split_param_groups(optimizer: torch.optim.Optimizer) -> None:
    """Split each parameter group into one group per tensor kind (plain tensors, DTensors of
    one mesh), keeping every group option and the `names` alignment."""
    if any(optimizer.state.values()):
        raise RuntimeError("split_param_groups must run before the optimizer has state")
    if all(len({_mesh_key(p) for p in g["params"]}) <= 1 for g in optimizer.param_groups):
        return  # nothing mixes kinds (data parallel): keep the groups, which an optimizer may share
    groups = []
    for g in optimizer.param_groups:
        names = g.get("names") or [None] * len(g["params"])
        buckets: dict = {}
        for p, n in zip(g["params"], names, strict=True):
            ps, ns = buckets.setdefault(_mesh_key(p), ([], []))
            ps.append(p)
            ns.append(n)
        for ps, ns in buckets.values():
            ng = {**g, "params": ps}
            if "names" in g:
                ng["names"] = ns
            groups.append(ng)
    optimizer.param_groups = groups


@torch.no_grad()
def reduce_partial_grads(params: list[torch.Tensor]) -> None:
    """Sum gradients DTensor left as pending partial sums: a replicated parameter used on
    sequence shards (the LayerNorms under sequence parallel) gets one partial gradient per rank."""
    from torch.distributed.tensor import Replicate

    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])


@torch.no_grad()
def allreduce_grads(params: list[torch.Tensor], group, world: int, bucket_numel: int = 1 << 25) -> None:
    """Average the gradients over `group` with a few flat all-reduces (one per ~128 MB bucket)."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    by_kind: dict = {}
    for g in grads:
        by_kind.setdefault((g.dtype, g.device), []).append(g)
    for same in by_kind.values():
        start = 0
        while start < len(same):
            bucket, n = [], 0
            while start < len(same) and (not bucket or n + same[start].numel() <= bucket_numel):
                bucket.append(same[start])
                n += same[start].numel()
                start += 1
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


@torch.no_grad()
def clip_sharded_grad_norm_(params: list[torch.Tensor], clip_norm: float, skip: set[int] | None = None,
                            sum_group=None) -> torch.Tensor:
    """Global L2 gradient norm when gradients are DTensor shards and/or plain replicas.

    Each rank sums the squares of its local pieces per (mesh, sharded mesh dims); a sum is
    all-reduced over exactly the mesh dims its tensors are split on, so replicated pieces
    count once. `sum_group` (the pipeline's ranks, which hold different parameters) then sums
    the totals; parameters in `skip` (ids: the tied embedding's second copy) are scaled but not
    counted. Then every piece is scaled by clip/max(norm, clip).
    """
    kinds: dict = {}
    skip = skip or set()
    scaled_only: list[torch.Tensor] = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if id(p) in skip:
            scaled_only.append(g.to_local() if isinstance(g, DTensor) else g)
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise RuntimeError(f"unreduced (Partial) gradient {g.placements}: cannot take its norm")
            # Any split placement (Shard, and the _StridedShard of FSDP2 over tensor parallel).
            dims = tuple(i for i, pl in enumerate(g.placements) if not (pl.is_replicate() or pl.is_partial()))
            key = (id(g.device_mesh), dims)
            kinds.setdefault(key, (g.device_mesh, dims, []))[2].append(g.to_local())
        else:
            kinds.setdefault(None, (None, (), []))[2].append(g)
    locals_ = [t for _, _, ts in kinds.values() for t in ts]
    if not locals_ and sum_group is None:
        return torch.zeros(())
    total_sq = torch.zeros((), dtype=torch.float64, device=(locals_ or scaled_only)[0].device)
    for mesh, dims, ts in kinds.values():
        # float64 across tensors: the sum runs over shards in another order than one process's.
        sq = torch.stack([n.double() for n in torch._foreach_norm(ts, 2.0)]).square().sum()
        for d in dims:
            dist.all_reduce(sq, group=mesh.get_group(d))
        total_sq = total_sq + sq
    if sum_group is not None:
        dist.all_reduce(total_sq, group=sum_group)
    total = total_sq.sqrt().float()
    locals_ += scaled_only
    if clip_norm > 0:
        coef = clip_norm / torch.clamp(total, min=clip_norm)
        torch._foreach_mul_(locals_, coef.to(locals_[0].dtype))
    return total


def check_tp_modules(model: nn.Module) -> None:
    """Tensor parallel splits plain nn.Linear layers; swapped modules (fake-quant, INT8) cannot be split."""
    moe = [i for i, blk in enumerate(model.blocks) if getattr(blk, "moe", None) is not None]
    if moe:
        raise ConfigError(f"Distributed.mp_degree: blocks.{moe[0]} is an MoE layer; tensor parallel does not split "
                          "experts (train MoE models with data parallel and Distributed.ep_degree)")
    for name, m in block_linears(model):
        if type(m) is not nn.Linear:
            raise ConfigError(f"Distributed.mp_degree: {name} is a {type(m).__name__}, not an "
                              "nn.Linear; tensor parallel splits plain Linear layers only (train QAT/pruned "
                              "models with data parallel or sharding)")
