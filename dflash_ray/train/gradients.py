"""A drafter rank's gradients for one step (a `DrafterWorker`'s): over its one batch, or over several
when it stands in for lost streams (`schedule.slots`), always those of the loss over the union of
every stream's batches. No Ray here.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


def extra_of(worker: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """The loss's arguments besides the batch: its decay, and the target's distribution where the
    family or distillation wants it (what the batch carries may be another drafter's)."""
    device = worker.place.device
    teacher = None
    if worker.drafter.cfg.settings.wants_target_distribution():  # the whole distribution, from its last hidden states
        teacher = batch["target_hidden"].to(device, worker.dtype)
    elif worker.cfg.distill > 0 and "teacher_ids" in batch:  # distillation's top-k
        teacher = (batch["teacher_ids"].to(device).long(), batch["teacher_probs"].to(device))
    return {"gamma": worker.cfg.loss_decay, "teacher": teacher, "distill": worker.cfg.distill}


def averaged(worker: Any, batch: dict[str, Any]):
    """Set every parameter's gradient (this rank's shard of it) to that of the loss over the union
    of all streams' batches: the loss sums and weights are all-reduced first (two numbers), each
    rank backpropagates its loss scaled by its share of the union's weight, and the sharded
    backward sums the ranks' gradients as it goes. Returns the step's forward output and the
    union's (loss, weight sum)."""
    import torch.distributed as dist

    # last step's gradients go before this forward, not after it: alive through it they would
    # add a whole set of gradients to the step's peak
    worker.opt.zero_grad(set_to_none=True)
    out = worker._forward(batch, worker.generator, True, **extra_of(worker, batch))
    weight = out.loss.weight_sum.detach().float()
    sums = torch.stack([out.loss.loss.detach().float() * weight, weight])
    if worker.group is not None:
        dist.all_reduce(sums, group=worker.group)
    total = sums[1].clamp_min(1e-12)
    (out.loss.loss * (weight / total)).backward()
    return out, float(sums[0] / total), float(total)


def accumulated(worker: Any, batches: Iterator[dict[str, Any]], passes: int):
    """`averaged` over several batches of this rank, one forward and backward at a time so the peak
    is one batch's. Every rank makes `passes` of them (FSDP2 gathers and reduce-scatters in each,
    together; the rows' all-reduce waits for the last: `across_rows`):
    a rank with fewer batches runs its last again at zero weight. Each backward is weighted by its
    own weight sum, and the gradients are divided by the union's once all are in (the reductions
    sum). Returns each real batch's `figures` and the union's (loss, weight sum)."""
    import torch.distributed as dist

    worker.opt.zero_grad(set_to_none=True)
    found: list[dict[str, Any]] = []
    sums = torch.zeros(2, device=worker.place.device)
    batch: dict[str, Any] | None = None
    for i in range(passes):
        across_rows(worker.drafter, i == passes - 1)
        fresh = next(batches, None)
        batch = fresh if fresh is not None else batch  # past this rank's own: its last again
        assert batch is not None, "a rank has at least one batch a step"
        out = worker._forward(batch, worker.generator, True, **extra_of(worker, batch))
        weight = out.loss.weight_sum.detach().float() * (1.0 if fresh is not None else 0.0)
        sums += torch.stack([out.loss.loss.detach().float() * weight, weight])
        (out.loss.loss * weight).backward()
        if fresh is not None:
            found.append(figures(worker, out, batch))
    if worker.group is not None:
        dist.all_reduce(sums, group=worker.group)
    total = sums[1].clamp_min(1e-12)
    for p in worker.drafter.parameters():
        if p.grad is not None:
            p.grad.div_(total)
    return found, float(sums[0] / total), float(total)


def across_rows(drafter: torch.nn.Module, last: bool) -> None:
    """An accumulation's passes reduce-scatter inside a row (a node's fast bus, the shards' memory
    unchanged) and all-reduce across the rows only on the last: a run standing in for lost streams
    sends its cross-node gradients once a step, as a calm one does."""
    allow = getattr(drafter, "set_requires_all_reduce", None)  # an FSDP2 module; a lone rank has none
    if allow is not None:
        allow(last)


def figures(worker: Any, out, batch: dict[str, Any]) -> dict[str, Any]:
    """One batch's figures for the step's row (floats: read back now)."""
    from dflash_ray.drafter.loss import per_position_accuracy

    acc = per_position_accuracy(out.loss.correct, out.blocks.weights, worker.drafter.cfg.block_size)
    return {
        "tau": float(out.tau.mean()) if out.tau.numel() else 1.0,
        "acc_k1": float(acc[worker.family.first_prediction]),
        "target_seconds": batch["seconds"],
        "handoff_seconds": batch.get("handoff_seconds", 0.0),
        "read_bytes": batch.get("read_bytes", 0),
        "tokens": int(batch["loss_mask"].numel()),
        "flops": worker.flops_per_position * out.blocks.token_ids.numel(),
    }
