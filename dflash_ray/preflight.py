"""Checks of a run's settings against each other that need no cluster and no data: every command
that can start the work (`pipeline`, `generate`, `train`) runs the ones it needs before anything
starts, and `plan` runs them all, so a config is refused at the desk, not hours into a run.
"""

from __future__ import annotations

import math

from dflash_ray.config import RunConfig, check_lengths
from dflash_ray.errors import DFlashError


def compiled_shapes(cfg: RunConfig) -> tuple[int, int]:
    """Graphs the drafter's compiled attention meets over a run of one drafter's settings, as (padded
    context lengths, graphs per length): one per length (`tokenize.max_seq_len / train.length_bucket`),
    per attention mask kind of its layers (sliding and full masks are different functions), per grad
    mode (training, and evaluation without gradients when `train.eval_every` is set)."""
    tr = cfg.train
    lengths = math.ceil(cfg.tokenize.max_seq_len / tr.length_bucket)
    return lengths, len(set(tr.layer_types or ["full_attention"])) * (2 if tr.eval_every else 1)


def check_compiled_shapes(cfg: RunConfig) -> None:
    """Refuse a drafter whose compiled attention would pass its graph limit mid-run (on a new length,
    hours in, and again after every restart). Only GPU runs compile it."""
    from dflash_ray.drafter.model import MAX_SHAPES
    from dflash_ray.train import drafters
    from dflash_ray.train.devices import planned_placement

    if planned_placement(cfg).attention != "flex":
        return
    keep = cfg.tokenize.max_seq_len
    for name, team in drafters.expand(cfg):
        lengths, per_length = compiled_shapes(team)
        if lengths * per_length > MAX_SHAPES:
            least = math.ceil(keep / max(1, MAX_SHAPES // per_length))
            who = f"drafter {name!r}: " if name else ""
            raise DFlashError(
                f"{who}tokenize.max_seq_len={keep} / train.length_bucket={team.train.length_bucket} gives "
                f"{lengths} padded lengths, x {per_length} (mask kinds x grad modes) = {lengths * per_length} compiled "
                f"attention graphs, above the limit of {MAX_SHAPES}: the run would fail at a new length mid-run; "
                f"allowed: train.length_bucket >= {least}, or a lower tokenize.max_seq_len",
                field="train.length_bucket",
            )


def check_settings(cfg: RunConfig) -> None:
    """The settings only their owners can read, refused naming the field: each drafter family's own
    (`train.family`, and each `train.drafters` entry's, on top of the run's when it keeps its family),
    read by the family module's `Settings` (it imports torch, which the config alone never does)."""
    from dflash_ray.config import expand_drafters
    from dflash_ray.drafter import families

    if cfg.train.family:
        families.settings(cfg.train.drafter, cfg.train.family, "train.family")
    for i, (_, team) in enumerate(expand_drafters(cfg) if cfg.train.drafters else []):
        if team.train.family:
            families.settings(team.train.drafter, team.train.family, f"train.drafters[{i}].family")


def preflight(cfg: RunConfig, *, generating: bool = True) -> list[str]:
    """Every settings check a run makes before it starts; returns the warnings (refusals raise).
    `generating`: the run generates its responses (the length rule of generation against tokenization)."""
    from dflash_ray.train import drafters
    from dflash_ray.train.devices import planned_placement

    check_settings(cfg)
    warnings = []
    if generating:
        warning = check_lengths(cfg)
        if warning:
            warnings.append(warning)
    drafters.expand(cfg)
    planned_placement(cfg)
    check_compiled_shapes(cfg)
    return warnings
