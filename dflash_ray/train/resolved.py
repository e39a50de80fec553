"""A training run resolved: what `preflight.resolve_run` decided once, top down, on the driver before
any actor starts (the settings checked, the target pinned, the placement, each drafter's shape and
start, the memory fit on GPUs). The coordinator and the stage execute it and derive none of it
again; the training summary's `resolved` section shows it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_ray.config import RunConfig
from dflash_ray.drafter.families import mask_and_layer_ids

if TYPE_CHECKING:
    from dflash_ray.train.devices import Placement


@dataclass(frozen=True, slots=True)
class ResolvedDrafter:
    name: str  # "" for a run's one drafter; else its `train.drafters` entry's name
    cfg: RunConfig  # its whole settings (`config.expand_drafters`)
    serving: dict  # its shape in the serving format's config (`train.shape.drafter_config`)
    init: str  # how it starts (`train.shape.drafter_init`): "target", "random", or "drafter:FOLDER"
    output: str  # where it writes: the run's output, or `OUTPUT/NAME`

    def section(self) -> dict[str, Any]:
        """What the summary says of it."""
        mask_id, layer_ids = mask_and_layer_ids(self.serving)
        return {
            **({"name": self.name} if self.name else {}),
            "family": self.cfg.train.drafter,
            "layers": self.serving["num_hidden_layers"],
            "block_size": self.serving["block_size"],
            "target_layer_ids": layer_ids,
            "mask_token_id": mask_id,
            "start": self.init,
        }


@dataclass(frozen=True, slots=True)
class ResolvedRun:
    target: str  # pinned: a Hub id names the commit every actor loads
    cfg: RunConfig
    placement: Placement  # what the stream actors will choose (`devices.planned_placement`)
    drafters: tuple[ResolvedDrafter, ...]
    memory_gb: dict[str, float] | None = None  # each GPU role's simulated peak (`planning.check_memory`); None on CPUs

    def section(self) -> dict[str, Any]:
        """The summary's `resolved` section: what ran."""
        p = self.placement
        return {
            "target": self.target,
            "placement": {
                "device": p.device,
                "attention": p.attention,
                "dtype": str(p.dtype).removeprefix("torch."),
                "backend": p.backend,
            },
            "drafters": [d.section() for d in self.drafters],
            **({"memory_gb": self.memory_gb} if self.memory_gb is not None else {}),
        }
