"""`train`: one section of flat keys (`train.lr`, `--set train.num_streams=8`), each group defined
beside what owns it: the drafter's shape (`drafter_shape`), the optimizer and schedule
(`optimizer`), the placement (`placement`), the resilience (`resilience`). A field's comment, and
its group's docstring, name the code that reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dflash_ray.errors import DFlashError
from dflash_ray.settings.drafter_shape import MOVED_TO_FAMILY, DrafterShape
from dflash_ray.settings.drafters import check_drafters
from dflash_ray.settings.optimizer import Optimizer
from dflash_ray.settings.placement import Placement
from dflash_ray.settings.resilience import Resilience


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig(
    Resilience, Placement, Optimizer, DrafterShape
):  # fields in the order shape, optimizer, placement, resilience
    # several drafters from one target pass (train/drafters.py): [{name: dspark, drafter: dspark, ...}, ...],
    # each trained on every batch's features, written under OUTPUT/NAME; empty: the one drafter above
    drafters: list = field(default_factory=list)

    MOVED: ClassVar[dict[str, str]] = {key: f"family.{key}" for key in MOVED_TO_FAMILY}  # keys that moved

    def check(self) -> None:
        """Each group's rules, and the drafters of `drafters` each as a whole run config (`check`).
        The family's own settings are its module's to read (`preflight.check_settings`: it imports torch)."""
        self.check_shape()
        self.check_placement()
        self.check_reports()
        if self.drafters and self.colocate:
            raise DFlashError(
                "one colocated actor holds one drafter; allowed with train.drafters: train.colocate=false",
                field="train.colocate",
            )
        if not isinstance(self.drafters, list):
            raise DFlashError(f"{self.drafters!r}: allowed: a list of drafters", field="train.drafters")
        check_drafters(self.drafters)
