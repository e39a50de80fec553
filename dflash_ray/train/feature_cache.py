"""A target actor's outputs for batches it has computed, kept on the host to serve again.

The target is frozen, so a batch's features (and target hidden states, distillation top-k) are the
same every time it is computed: later epochs and every held-out evaluation can take them from here
instead of running the target's forward again. Each entry is one whole batch, exactly as the forward
gave it, so a hit is bitwise what a recompute would give. Training batches recur when `batch_size` is
1 (a sample is its own batch every epoch); held-out batches recur at every evaluation whatever the
size. Entries are kept first come, first kept, until the byte budget is spent: nothing is evicted, so
a cache too small for the run still serves the samples it holds every epoch. The anchor seeds are no
part of an entry: they name the epoch, and the target adds the present one's to every batch it serves
(`target_worker.anchor_seeds`).
"""

from __future__ import annotations

import torch

from dflash_ray.train.schedule import Sample


class FeatureCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._batches: dict[tuple[Sample, ...], dict[str, torch.Tensor]] = {}

    def get(self, samples: list[Sample], device: torch.device | str) -> dict[str, torch.Tensor] | None:
        """The batch's tensors on `device`, or None when it was not kept."""
        kept = self._batches.get(tuple(samples))
        if kept is None:
            return None
        # a copy: whoever takes the batch may change it in place (a colocated drafter's step)
        return {k: v.to(device, copy=True) for k, v in kept.items()}

    def keep(self, samples: list[Sample], batch: dict[str, torch.Tensor]) -> bool:
        """Keep a host copy of `batch` if the budget has room for it; whether it was kept."""
        if not self.budget:
            return False
        size = sum(v.numel() * v.element_size() for v in batch.values())
        if self.used + size > self.budget or tuple(samples) in self._batches:
            return False
        # a copy: the caller's tensors may be staging buffers or device memory that is reused
        self._batches[tuple(samples)] = {k: v.detach().to("cpu", copy=True) for k, v in batch.items()}
        self.used += size
        return True
