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

from typing import Any

from dflash_ray.config import expand_drafters, expand_train


def expand(cfg: Any) -> list[tuple[str, Any]]:
    """(name, RunConfig) for every drafter of the run (`config.expand_drafters`)."""
    return expand_drafters(cfg)


def target_sends(tcfg: Any) -> tuple[int, bool]:
    """What the target sends beside the features, when any drafter of the run uses it (entries change
    `distill`, `drafter` and `family`): distillation's top-k (0: none), and whether its last hidden
    states go too, for a loss that turns them into the whole distribution (not hard labels alone)."""
    from dflash_ray.drafter import families

    teams = [t for _, t in expand_train(tcfg)]
    top_k = tcfg.distill_top_k if any(t.distill > 0 for t in teams) else 0
    return top_k, any(families.settings(t.drafter, t.family).wants_target_distribution() for t in teams)


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
