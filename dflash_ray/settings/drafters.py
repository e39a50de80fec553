"""Several drafters from one target pass (`train.drafters`, run by `train/drafters.py`): which
settings one drafter may set, and each drafter's whole `train` section."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from dflash_ray.errors import DFlashError
from dflash_ray.settings.coerce import coerce_field
from dflash_ray.settings.drafter_shape import MOVED_TO_FAMILY

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


def check_drafters(entries: list) -> None:
    """Refuse an entry that is no {name, settings} mapping, a bad or repeated name, or a setting
    that is not a drafter's, naming the entry."""
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


def expand_drafters(cfg: Any) -> list[tuple[str, Any]]:
    """(name, RunConfig) for every drafter of the run; a drafter's own config lists no drafters.
    Each is checked whole, a value out of range naming the entry it came from."""
    if not cfg.train.drafters:
        return [("", cfg)]
    runs = []
    for i, entry in enumerate(cfg.train.drafters):
        train = _entry_train(cfg.train, i, entry)  # a value of the wrong type names its entry's field
        try:
            runs.append((entry["name"], dataclasses.replace(cfg, train=train)))
        except DFlashError as e:  # a value out of range: name the entry it came from
            field = f"train.drafters[{i}].{e.field.split('.', 1)[1]}" if e.field else f"train.drafters[{i}]"
            raise DFlashError(str(e).split(": ", 1)[-1] if e.field else str(e), field=field) from None
    return runs


def expand_train(tcfg: Any) -> list[tuple[str, Any]]:
    """(name, TrainConfig) for every drafter of a run whose config was checked (`expand_drafters`)."""
    if not tcfg.drafters:
        return [("", tcfg)]
    return [(entry["name"], _entry_train(tcfg, i, entry)) for i, entry in enumerate(tcfg.drafters)]


def _entry_train(tcfg: Any, i: int, entry: dict[str, Any]) -> Any:
    """`train` with entry i's settings: its `family` settings on top of `train.family` when it keeps
    the run's family, alone when it names another."""
    settings = {k: coerce_field(type(tcfg), k, v, f"train.drafters[{i}].{k}") for k, v in entry.items() if k != "name"}
    same = settings.get("drafter", tcfg.drafter) == tcfg.drafter
    settings["family"] = {**(tcfg.family if same else {}), **settings.get("family", {})}
    return dataclasses.replace(tcfg, drafters=[], **settings)
