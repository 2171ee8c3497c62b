"""Tensor (and sequence) parallelism for the GPT, applied from outside with DTensor plans.

Megatron's split (spec §1.7): in every block `qkv_proj` and `linear1` are column-parallel and
`out_proj` and `linear2` row-parallel, so each rank computes whole attention heads and a slice
of the FFN, with one all-reduce after attention and one after the MLP (forward and backward).
The fused QKV rows are grouped per head (`[q_h0 k_h0 v_h0 q_h1 …]`), so the column split of
`qkv_proj` hands each rank whole heads and attention reads the local head count from the
tensor: the model code does not change.

The embeddings, LayerNorms and the tied output projection stay replicated: each rank of a
tensor-parallel group computes the same logits and loss (the reference splits the vocabulary
with a parallel cross-entropy; see docs/distributed.md).

Sequence parallel (`Model.sequence_parallel`) keeps the activations between the matmuls split
along the sequence (`Shard(1)` of `[B, S, h]`): the LayerNorms run on `S/mp` tokens, the
column-parallel inputs all-gather the sequence and the row-parallel outputs reduce-scatter it,
so the two all-reduces become an all-gather + reduce-scatter pair and the residual stream,
LayerNorms and dropout use 1/mp of the memory. The embedding output is split before the first
block and the final LayerNorm output gathered again before the (replicated) logits.
"""

from __future__ import annotations

from torch import nn


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool) -> dict:
    """{module path: ParallelStyle} for `parallelize_module`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict = {}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        if sequence_parallel:
            seq = Shard(1)
            plan.update({
                f"{b}.norm1": SequenceParallel(),
                f"{b}.norm2": SequenceParallel(),
                f"{b}.attn.qkv_proj": ColwiseParallel(input_layouts=seq),
                f"{b}.linear1": ColwiseParallel(input_layouts=seq),
                # DTensor outputs: the residual add stays a sharded DTensor op.
                f"{b}.attn.out_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
                f"{b}.linear2": RowwiseParallel(output_layouts=seq, use_local_output=False),
            })
        else:
            plan.update({
                f"{b}.attn.qkv_proj": ColwiseParallel(),
                f"{b}.linear1": ColwiseParallel(),
                f"{b}.attn.out_proj": RowwiseParallel(),
                f"{b}.linear2": RowwiseParallel(),
            })
    if sequence_parallel:
        # Block inputs are (x, mask, is_causal, cache): split x along the sequence (a local
        # slice, no communication); its gradient is all-gathered on the way back.
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(), None, None, None),
                                              desired_input_layouts=(Shard(1), None, None, None),
                                              use_local_output=False)
        plan["norm"] = SequenceParallel()
    return plan


def apply_tensor_parallel(model: nn.Module, mesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model`'s block projections over the 1-D `mesh` in place; returns the model."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, parallelize_module

    parallelize_module(model, mesh, tensor_parallel_plan(model, sequence_parallel))
    if sequence_parallel:
        # After the final LayerNorm the logits need every position: gather the sequence back
        # into a plain tensor (the tied projection's weight is a plain replicated tensor).
        parallelize_module(model.norm, mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
    return model


__all__ = ["apply_tensor_parallel", "tensor_parallel_plan"]
