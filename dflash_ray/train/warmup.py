"""Every graph shape a run's drafter meets, met before step 0. On GPUs each (batch, padded length,
grad mode) is a graph compiled on its first use, and the drafters advance in lock-step: met mid-run,
a compile stalls every rank while the sends posted meanwhile age towards NCCL's watchdog. Met here,
on zero inputs, while the run is still starting. torch's compiled artifacts of the run
(`compile_cache`) are loaded first when they exist, and saved (rank 0) as the shapes are met, at
most every `SAVE_EVERY_S` and once at the end: a warm-up killed half way (a deadline, a lost node)
keeps the compiles it did, and the restart compiles only the rest. Under the GPU's clocks
(`train.clocks`) the shapes the clock charged a compile for are kept beside them, as the GPU's
kernels travel in the artifacts. Each shape met is counted as progress (`dflash_ray.progress`): the
coordinator waits on each rank while it meets shapes. No Ray here.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from dflash_ray import progress, storage
from dflash_ray.train import compile_cache

SAVE_EVERY_S = 15.0  # a GPU compiles a shape in 10-60 s: about a save a shape there, few on the CPU


def warm_up(worker: Any, shapes: list[tuple[int, int, bool]], cache: str | None) -> dict[str, Any]:
    """Run `worker`'s (a `DrafterWorker`'s) forward, and backward for the training shapes, once per
    shape of `shapes`; the weights, optimizer and anchor RNG are untouched (the gradients made are
    dropped). Every rank of a drafter calls it with the same shapes (sharded weights are gathered
    collectively). Nothing compiles on the CPU's dense attention unless the GPU's clocks are replayed
    (`train.clocks`). Returns the shapes met, those the clock charged a compile for (`compiled`),
    the seconds and the bytes loaded and saved."""
    start = time.perf_counter()
    loaded = _load(worker, cache) if cache else {}
    charged = len(worker.clock.compiled)
    compiles = worker.place.attention == "flex" or worker.clock.on
    keeper = _Keeper(worker, cache if cache and worker.rank == 0 and compiles else None)
    met = 0
    with progress.doing(f"compiling graph shapes ({len(shapes)} to meet)"):
        for shape in shapes if compiles else []:
            _meet(worker, shape)
            met += 1
            progress.add(1)  # the coordinator waits while this rank meets shapes (`Deadlines.wait_progressing`)
            keeper.maybe_save()
    worker.drafter.zero_grad(set_to_none=True)
    saved = keeper.save() if met else {}
    return {
        "shapes": met,
        "compiled": len(worker.clock.compiled) - charged,
        "seconds": time.perf_counter() - start,
        "loaded_bytes": loaded.get("loaded_bytes", 0),
        "saved_bytes": saved.get("saved_bytes", 0),
    }


def _meet(worker: Any, shape: tuple[int, int, bool]) -> None:
    """One forward (and backward, for a training shape) of zeros at `shape`."""
    B, S, grad = shape
    hidden = worker.drafter.cfg.hidden_size
    layers = max(worker.pick) + 1 if worker.pick else len(worker.drafter.cfg.target_layer_ids)  # as captured
    batch = {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "loss_mask": torch.ones(B, S, dtype=torch.long),
        "features": torch.zeros(B, S, layers * hidden),
    }
    extra: dict[str, Any] = {"gamma": worker.cfg.loss_decay}
    if worker.drafter.cfg.settings.wants_target_distribution():
        extra["teacher"] = torch.zeros(B, S, hidden, device=worker.place.device, dtype=worker.dtype)
    with torch.set_grad_enabled(grad):
        out = worker._forward(batch, torch.Generator().manual_seed(0), grad, **extra)
        if grad:
            out.loss.loss.backward()


def shapes_uri(cache: str) -> str:
    """Beside the artifacts: the shapes the GPU's clock has compiled (`train.clocks`)."""
    return cache[: -len(".bin")] + ".shapes.json" if cache.endswith(".bin") else cache + ".shapes.json"


def _load(worker: Any, cache: str) -> dict[str, Any]:
    loaded = compile_cache.load(cache)
    if worker.clock.on:
        try:
            worker.clock.compiled |= {tuple(s) for s in json.loads(storage.read_text(shapes_uri(cache)))}
        except FileNotFoundError:
            pass
    return loaded


class _Keeper:
    """Rank 0's saves of what the warm-up compiled so far (`cache` None: this rank saves nothing)."""

    def __init__(self, worker: Any, cache: str | None):
        self.worker, self.cache = worker, cache
        self.last = time.monotonic()
        self.kept = len(worker.clock.compiled)

    def maybe_save(self) -> None:
        if self.cache and time.monotonic() - self.last >= SAVE_EVERY_S:
            self.save()

    def save(self) -> dict[str, Any]:
        if not self.cache:
            return {}
        saved = compile_cache.save(self.cache)
        clock = self.worker.clock
        if clock.on and len(clock.compiled) != self.kept:
            storage.write_text(shapes_uri(self.cache), json.dumps(sorted(clock.compiled)))
            self.kept = len(clock.compiled)
        self.last = time.monotonic()
        return saved
