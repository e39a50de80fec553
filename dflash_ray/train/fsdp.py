"""The drafter's weights, gradients and optimizer state sharded over the data-parallel ranks (FSDP2).

With N > 1 streams every decoder layer and then the whole drafter are `fully_shard`ed: each rank
holds 1/N of the fp32 master weights, of their gradients and of AdamW's two moments; a layer's
weights are all-gathered (bf16 on a GPU) just before it runs and its gradients reduce-scattered
(fp32) as soon as its backward is done, overlapping the next layer's backward. The root (fc, the
norms, a family's selector or heads) stays gathered from its forward to its backward, so a family's
loss may use any of its modules after the forward. With one stream nothing is wrapped and nothing
communicates. No Ray here.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn


def apply_fsdp(drafter: nn.Module, device_type: str, group, dtype: torch.dtype) -> None:
    """Shard `drafter` in place over the ranks of process `group` (the drafter's own ranks, which may
    be a subgroup of the run's), or over a `DeviceMesh` made beforehand. Gradients are summed, not
    averaged: the caller scales each rank's loss by its share of the union's weight."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = group if isinstance(group, DeviceMesh) else DeviceMesh.from_group(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for module in [*cast(nn.ModuleList, drafter.layers), drafter]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
        module.set_gradient_divide_factor(1.0)  # each wrapped module's own setting
        module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)


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
