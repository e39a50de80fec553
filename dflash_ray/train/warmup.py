"""Every graph shape a run's drafter meets, met before step 0. On GPUs each (batch, padded length,
grad mode) is a graph compiled on its first use, and the drafters advance in lock-step: met mid-run,
a compile stalls every rank while the sends posted meanwhile age towards NCCL's watchdog. Met here,
on zero inputs, while the run is still starting. torch's compiled artifacts of the run
(`compile_cache`) are loaded first when they exist and saved after (rank 0), so a restart or a
resumed run compiles nothing again. No Ray here.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def warm_up(worker: Any, shapes: list[tuple[int, int, bool]], cache: str | None) -> dict[str, Any]:
    """Run `worker`'s (a `DrafterWorker`'s) forward, and backward for the training shapes, once per
    shape of `shapes`; the weights, optimizer and anchor RNG are untouched (the gradients made are
    dropped). Every rank of a drafter calls it with the same shapes (sharded weights are gathered
    collectively). Nothing compiles on the CPU's dense attention unless the GPU's clocks are replayed
    (`train.clocks`): then it only loads and saves nothing."""
    from dflash_ray.train import compile_cache

    start = time.perf_counter()
    loaded = compile_cache.load(cache) if cache else {}
    compiles = worker.place.attention == "flex" or worker.clock.on
    hidden = worker.drafter.cfg.hidden_size
    layers = max(worker.pick) + 1 if worker.pick else len(worker.drafter.cfg.target_layer_ids)  # as captured
    generator = torch.Generator().manual_seed(0)
    met = 0
    for B, S, grad in shapes if compiles else []:
        batch = {
            "input_ids": torch.zeros(B, S, dtype=torch.long),
            "loss_mask": torch.ones(B, S, dtype=torch.long),
            "features": torch.zeros(B, S, layers * hidden),
        }
        extra: dict[str, Any] = {"gamma": worker.cfg.loss_decay}
        if worker.drafter.cfg.settings.wants_target_distribution():
            extra["teacher"] = torch.zeros(B, S, hidden, device=worker.place.device, dtype=worker.dtype)
        with torch.set_grad_enabled(grad):
            out = worker._forward(batch, generator, grad, **extra)
            if grad:
                out.loss.loss.backward()
        met += 1
    worker.drafter.zero_grad(set_to_none=True)
    saved = compile_cache.save(cache) if cache and worker.rank == 0 and met else {}
    return {
        "shapes": met,
        "seconds": time.perf_counter() - start,
        "loaded_bytes": loaded.get("loaded_bytes", 0),
        "saved_bytes": saved.get("saved_bytes", 0),
    }
