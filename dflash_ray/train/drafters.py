"""Several drafters from one target pass: `train.drafters` lists them, each a name and the drafter
settings it changes from `train` (any family, any shape, its own optimizer settings). An entry's
`family` settings go on top of `train.family` when it keeps the run's family, and alone when it
names another.

Each becomes a whole `RunConfig` of its own; the run's target captures the union of their layers
once per batch and every drafter trains on it, writing its checkpoints and metrics under
`OUTPUT/NAME/` (each folder is what a one-drafter run writes, so `export` and `evaluate` take it as
it is). With the list empty the run has one drafter, named "", writing to `OUTPUT` itself.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from dflash_ray.errors import DFlashError

# what may differ between the drafters of one run: their shape, family and optimizer; the data,
# the schedule and the placement are the run's
PER_DRAFTER = (
    "drafter",
    "family",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "init",
    "block_size",
    "layer_types",
    "sliding_window",
    "loss_decay",
    "distill",
    "num_target_features",
    "target_layer_ids",
    "mask_token_id",
    "lr",
    "weight_decay",
    "warmup_ratio",
    "clip",
    "num_anchors",
)
NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def check(entries: list) -> None:
    """Refuse an entry that is no {name, settings} mapping, a bad or repeated name, or a setting
    that is not a drafter's, naming the entry."""
    from dflash_ray.config import MOVED_TO_FAMILY

    names = set()
    for i, entry in enumerate(entries):
        where = f"train.drafters[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not NAME.match(entry["name"]):
            raise DFlashError(
                f"{entry!r}: allowed: a mapping with a `name` (lowercase letters, digits, '.', '_', "
                "'-'; it names the drafter's folder) and drafter settings",
                field=where,
            )
        if entry["name"] in names:
            raise DFlashError(f"the name {entry['name']!r} is given twice; allowed: distinct names", field=where)
        names.add(entry["name"])
        moved = sorted(set(entry) & set(MOVED_TO_FAMILY))
        if moved:
            raise DFlashError(f"{where}.{moved[0]} moved to {where}.family.{moved[0]}", field=f"{where}.{moved[0]}")
        other = sorted(set(entry) - {"name"} - set(PER_DRAFTER))
        if other:
            raise DFlashError(
                f"{other} are the run's settings, not one drafter's; allowed here: {', '.join(PER_DRAFTER)}",
                field=f"{where}.{other[0]}",
            )


def expand(cfg: Any) -> list[tuple[str, Any]]:
    """(name, RunConfig) for every drafter of the run; a drafter's own config lists no drafters."""
    from dflash_ray.config import TrainConfig, coerce_field

    entries = cfg.train.drafters
    if not entries:
        return [("", cfg)]
    runs = []
    for i, entry in enumerate(entries):
        settings = {
            k: coerce_field(TrainConfig, k, v, f"train.drafters[{i}].{k}") for k, v in entry.items() if k != "name"
        }
        same = settings.get("drafter", cfg.train.drafter) == cfg.train.drafter
        settings["family"] = {**(cfg.train.family if same else {}), **settings.get("family", {})}
        try:
            train = dataclasses.replace(cfg.train, drafters=[], **settings)
            runs.append((entry["name"], dataclasses.replace(cfg, train=train)))
        except DFlashError as e:  # a value out of range: name the entry it came from
            field = f"train.drafters[{i}].{e.field.split('.', 1)[1]}" if e.field else f"train.drafters[{i}]"
            raise DFlashError(str(e).split(": ", 1)[-1] if e.field else str(e), field=field) from None
    return runs


def outputs(output: str, cfg: Any) -> list[str]:
    """Where each drafter of the run writes: `output` itself, or `output/NAME` for each listed one."""
    from dflash_ray import storage

    return [storage.join(output, name) if name else output for name, _ in expand(cfg)]


def union_layers(layer_ids: list[list[int]]) -> tuple[list[int], list[list[int] | None]]:
    """The target layers to capture for all the drafters, and each drafter's positions among them
    (None: it uses them all, in order, so its features pass unchanged)."""
    union = sorted({i for ids in layer_ids for i in ids})
    picks = [None if ids == union else [union.index(i) for i in ids] for ids in layer_ids]
    return union, picks
