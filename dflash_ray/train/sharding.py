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

from typing import Any

import torch
from torch import nn


def shard(drafter: nn.Module, device_type: str, group, dtype: torch.dtype) -> None:
    """Shard `drafter` in place over the ranks of process `group` (the drafter's own ranks, which may
    be a subgroup of the run's). Gradients are summed, not averaged: the caller scales each rank's
    loss by its share of the union's weight."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for module in [*drafter.layers, drafter]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
        module.set_gradient_divide_factor(1.0)  # each wrapped module's own setting
        module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-multiplied one)


def full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a shard (collective: every rank calls it), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def flat(tensors) -> torch.Tensor:
    """The tensors whole, flattened into one (collective when they are shards)."""
    return torch.cat([full(t).flatten() for t in tensors])


def _keep(t: torch.Tensor, rank: int) -> torch.Tensor | None:
    """`t` whole on rank 0's host; None elsewhere (every rank takes part in the gathering)."""
    whole = full(t.detach())
    return whole.cpu() if rank == 0 else None


def full_state(drafter: nn.Module, opt: torch.optim.Optimizer, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The whole weights and optimizer state, keyed by parameter name, so a checkpoint reads the same
    whatever the number of ranks that wrote it. Collective: every rank calls it, and the tensors are
    gathered one at a time in the same order everywhere; rank 0 gets the state, the others {}."""
    weights = {name: _keep(t, rank) for name, t in drafter.state_dict().items()}
    names = {p: name for name, p in drafter.named_parameters()}
    state = {names[p]: {k: _keep(v, rank) for k, v in opt.state[p].items()}
             for group in opt.param_groups for p in group["params"] if p in opt.state}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
              for g in opt.param_groups]
    return ({}, {}) if rank else (weights, {"state": state, "param_groups": groups})


def _local(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `whole`, cut from it here (no communication: every rank read it whole)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(like, DTensor) and whole.dim() > 0:
        return distribute_tensor(whole.to(like.device), like.device_mesh, like.placements, src_data_rank=None)
    return whole


@torch.no_grad()
def load_full_state(drafter: nn.Module, opt: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                    optimizer: dict[str, Any]) -> None:
    """Every rank loads the whole state it read (`full_state`'s) and keeps its own piece of it."""
    own = drafter.state_dict()
    if set(own) != set(weights):
        raise ValueError(f"checkpoint weights do not match the drafter: missing {sorted(set(own) - set(weights))}, "
                         f"unexpected {sorted(set(weights) - set(own))}")
    for name, t in own.items():
        t.copy_(_local(weights[name].to(t.dtype), t))
    params = dict(drafter.named_parameters())
    order = [name for group in optimizer["param_groups"] for name in group["params"]]
    opt.load_state_dict({
        "state": {i: {k: _local(v, params[name]) for k, v in optimizer["state"][name].items()}
                  for i, name in enumerate(order) if name in optimizer["state"]},
        "param_groups": [{**g, "params": [order.index(n) for n in g["params"]]} for g in optimizer["param_groups"]]})


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
