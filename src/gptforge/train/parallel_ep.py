"""Expert parallel: every MoE layer's experts split over `Distributed.ep_degree` data ranks,
tokens sent to the rank that owns their expert with all-to-all (docs/moe.md).

The data ranks form a ("edp", "ep") mesh: consecutive ranks are one expert-parallel group.
Each rank keeps E/ep experts per layer as DTensors sharded on "ep" (replicated on "edp"), so
clipping, the optimizer and distributed checkpoints see the whole expert tensor. Gating and
the dense weights stay replicated (DDP). A layer's forward: route the local tokens, exchange
per-expert counts, all-to-all the token rows to their experts' ranks, run the local experts as
one grouped GEMM, all-to-all the outputs back and combine them; autograd runs the same
exchanges backwards. An expert's gradient then sums its tokens from every rank of the group;
`finish_expert_grads` sums it over "edp" and divides by the data world (what DDP does for the
dense weights), so dp × ep equals one process that sees the same micro-batches.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from gptforge.errors import ConfigError
from gptforge.model.moe import MoEFFN, Routing, combine, expert_ffn, moe_layers

_MESHES: dict = {}


def ep_mesh(data_world: int, ep: int, device: torch.device):
    """The ("edp", "ep") mesh over the data ranks (one per layout and process)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, data_world, ep)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (data_world // ep, ep), mesh_dim_names=("edp", "ep"))
    return _MESHES[key]


def apply_expert_parallel(model: nn.Module, mesh) -> list[str]:
    """Keep this rank's experts (as DTensor shards) and route through all-to-all; returns the
    names of the expert parameters (DDP must leave them alone)."""
    ep = mesh["ep"]
    size, rank = ep.size(), ep.get_local_rank()
    names = []
    for name, moe in model.named_modules():
        if not isinstance(moe, MoEFFN):
            continue
        if moe.num_experts % size:
            raise ConfigError(f"Distributed.ep_degree={size}: does not divide the {moe.num_experts} experts of {name}")
        local = moe.num_experts // size
        ex = moe.experts
        for pname, p in list(ex.named_parameters(recurse=False)):
            shard = p.detach()[rank * local:(rank + 1) * local].clone()
            dt = DTensor.from_local(shard, mesh, [Replicate(), Shard(0)], run_check=False)
            setattr(ex, pname, nn.Parameter(dt, requires_grad=p.requires_grad))
            names.append(f"{name}.experts.{pname}")
        moe._ep = (ep.get_group(), size, rank, local)
        moe.dispatch = types.MethodType(_dispatch_all_to_all, moe)
    return names


def _dispatch_all_to_all(self: MoEFFN, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
    group, size, rank, local = self._ep
    counts = torch.tensor(routing.counts, dtype=torch.int64, device=flat.device)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)  # [source rank, my local expert]
    send_splits = counts.view(size, local).sum(1).tolist()
    rc = recv.view(size, local).tolist()
    recv_splits = [sum(r) for r in rc]
    xs = flat[routing.token]
    xr = dist_fn.all_to_all_single(flat.new_empty(sum(recv_splits), flat.shape[1]), xs,
                                   recv_splits, send_splits, group=group)
    # xr is source-major; the experts want their rows together: (expert, source) order.
    starts, off = [], 0
    for p in range(size):
        row = []
        for e in range(local):
            row.append(off)
            off += rc[p][e]
        starts.append(row)
    order = [torch.arange(starts[p][e], starts[p][e] + rc[p][e], device=flat.device)
             for e in range(local) for p in range(size)]
    idx = torch.cat(order) if order else torch.zeros(0, dtype=torch.long, device=flat.device)
    local_counts = [sum(rc[p][e] for p in range(size)) for e in range(local)]
    ex = self.experts
    ys = expert_ffn(xr[idx], local_counts, *(t.to_local() for t in (
        ex.linear1_weight, ex.linear1_bias, ex.linear2_weight, ex.linear2_bias)))
    yr = ys[torch.argsort(idx)]  # back to source-major
    yb = dist_fn.all_to_all_single(yr.new_empty(xs.shape[0], flat.shape[1]), yr.contiguous(),
                                   send_splits, recv_splits, group=group)
    return combine(flat, yb, routing)


@torch.no_grad()
def finish_expert_grads(model: nn.Module, mesh, data_world: int) -> None:
    """Expert gradients: sum over the ranks holding the same experts ("edp"), then average over
    the data world as DDP does for the dense weights."""
    edp = mesh["edp"]
    for moe in moe_layers(model):
        for p in moe.experts.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if edp.size() > 1:
                dist.all_reduce(g, group=edp.get_group())
            g.div_(data_world)
