"""`train`'s drafter: its family and shape, and which target layers it reads. Read by
`train/shape.py` (the drafter's config from these and the target's), `drafter/families.py` and
`train/drafters.py`; a family's own settings (`family`) are its module's `Settings`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dflash_ray.errors import DFlashError
from dflash_ray.settings.fields import above, at_least, within

LAYER_TYPES = ("full_attention", "sliding_attention")
# settings that were `train`'s own and are now a family's (`train.family`)
MOVED_TO_FAMILY = ("markov_rank", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def family_names() -> tuple[str, ...]:
    """Every family: the modules of `dflash_ray/drafter` that define `FAMILY` (read, not imported)."""
    folder = Path(__file__).parent.parent / "drafter"
    return tuple(
        sorted(
            p.stem for p in folder.glob("*.py") if re.search(r"^FAMILY = ", p.read_text(encoding="utf-8"), re.MULTILINE)
        )
    )


@dataclass(frozen=True, kw_only=True)
class DrafterShape:
    drafter: str = "dflash"  # the drafter family: a module of dflash_ray/drafter (families.py): dflash, dspark, dflash2
    # that family's own settings and loss weights (its module's `Settings`), e.g. {markov_rank: 64}; unset: defaults
    family: dict = field(default_factory=dict)
    num_layers: int = at_least(1, default=1, most=1024)
    num_heads: int | None = at_least(1, default=None, most=1024)  # drafter attention shape; None: the target's
    num_kv_heads: int | None = at_least(1, default=None, most=1024)
    head_dim: int | None = at_least(2, default=None, most=4096)
    intermediate_size: int | None = at_least(1, default=None, most=1 << 20)  # drafter MLP width; None: the target's
    init: Literal["auto", "target", "random"] = "auto"  # copies of the target's next layers, or random
    # a released drafter the run starts from (its exported folder, local or s3://, or a Hub id ORG/NAME[@REV]):
    # its weights, a fresh optimizer (drafter/warm_start.py); shapes, mask token and captured layers must
    # match; block_size is free
    init_from: str = ""
    block_size: int = at_least(2, default=16, most=1024)
    layer_types: list | None = None  # per layer "full_attention" | "sliding_attention"; None: all full
    sliding_window: int = at_least(1, default=2048, most=1 << 22)  # context positions a sliding-attention layer sees
    # gamma: the i-th prediction of a block weighs exp(-i/gamma) (drafter/blocks.py `position_weights`);
    # None: the family's default (dflash, dflash2: 7 * block_size / 16; dspark: 4)
    loss_decay: float | None = above(0, default=None)
    # share of each position's target that is the target model's own distribution (0: hard labels)
    distill: float = within(0, 1, default=0.0)
    # how much of that distribution the target actor sends: its top-k, renormalized
    distill_top_k: int = at_least(1, default=32)
    num_target_features: int = at_least(1, default=5, most=1024)
    target_layer_ids: list | None = None
    mask_token_id: int | None = at_least(0, default=None)  # None: the last vocabulary row that is not a special token

    def check_shape(self) -> None:
        """The family, the captured target layers and the drafter's own layer types, each against
        what it can mean."""
        if self.drafter not in family_names():
            raise DFlashError(f"{self.drafter!r} is not one of {list(family_names())}", field="train.drafter")
        ids = self.target_layer_ids
        if ids is not None and (
            not ids
            or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids)
            or any(a >= b for a, b in zip(ids, ids[1:]))
        ):
            raise DFlashError(
                f"{ids!r}: allowed: a non-empty, sorted list of unique non-negative layer indices",
                field="train.target_layer_ids",
            )
        if self.layer_types is not None:
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if bad:
                raise DFlashError(f"unknown {bad}; allowed entries: {list(LAYER_TYPES)}", field="train.layer_types")
            if len(self.layer_types) != self.num_layers:
                raise DFlashError(
                    f"{len(self.layer_types)} entries for train.num_layers={self.num_layers}; allowed: one per "
                    "drafter layer",
                    field="train.layer_types",
                )
