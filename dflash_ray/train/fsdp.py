"""The drafter's weights, gradients and optimizer state over the data-parallel ranks (FSDP2).

With N > 1 streams every decoder layer and then the whole drafter are `fully_shard`ed over a mesh
of the ranks (`train/mesh.py`): one row of all N (each rank holds 1/N of the fp32 master weights,
their gradients and AdamW's two moments), or rows that replicate one another (HSDP: a row inside a
node, its gradients all-reduced across the rows once a step; rows of one rank: plain replication).
A layer's weights are all-gathered (bf16 on a GPU) just before its forward and, unless kept
gathered until its backward (`keep_gathered`: one gather a step instead of two, for a layer's
bf16 weights held), again before its backward; its gradients are reduce-scattered in
`reduce_dtype` as soon as its backward is done, overlapping the next layer's. The root (fc, the
norms, a family's selector or heads) stays gathered from its forward to its backward, so a family's
loss may use any of its modules after the forward. With one stream nothing is wrapped and nothing
communicates. No Ray here.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def apply_fsdp(
    drafter: nn.Module,
    device_type: str,
    group,
    dtype: torch.dtype,
    *,
    reduce_dtype: torch.dtype = torch.float32,
    keep_gathered: bool = False,
) -> None:
    """Shard `drafter` in place over the ranks of process `group` (the drafter's own ranks, which may
    be a subgroup of the run's), or over a `DeviceMesh` made beforehand (`mesh_of`: 2-D for HSDP).
    Gradients are summed, not averaged: the caller scales each rank's loss by its share of the
    union's weight."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    for layer in cast(nn.ModuleList, drafter.layers):
        _sum_reduced(fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep_gathered))
    _sum_reduced(fully_shard(drafter, mesh=mesh, mp_policy=policy))  # the root: FSDP2's own rule


def _sum_reduced(module) -> None:
    module.set_gradient_divide_factor(1.0)  # each wrapped module's own setting
    module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)


def make_mesh_groups(rows: list[list[int]], timeout) -> tuple:
    """The process groups of a mesh whose rows are `rows` (global ranks): one per row (they shard),
    then one per column (they replicate). Collective over the default group: every rank of it calls
    this with the same rows, in the same order. Returns (this rank's row group, its column group),
    None where this rank is in neither."""
    import torch.distributed as dist

    if not rows:
        return None, None
    me = dist.get_rank()
    row_group = column_group = None
    for row in rows:
        g = dist.new_group(row, timeout=timeout)
        row_group = g if me in row else row_group
    for column in zip(*rows):
        g = dist.new_group(list(column), timeout=timeout)
        column_group = g if me in column else column_group
    return row_group, column_group


def mesh_of(rows: list[list[int]], groups: tuple, device_type: str):
    """The 2-D (replicate, shard) `DeviceMesh` of `rows` (global ranks) from this rank's row and
    column groups (`make_mesh_groups`)."""
    from torch.distributed.device_mesh import DeviceMesh

    row_group, column_group = groups
    return DeviceMesh.from_group(
        [column_group, row_group],
        device_type,
        mesh=torch.tensor(rows, dtype=torch.int),
        mesh_dim_names=("replicate", "shard"),
    )


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a shard (collective: every rank calls it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def optimizer_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shard's moments)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total
