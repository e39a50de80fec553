"""Checks of a run's settings against each other that need no cluster and no data: every command
that can start the work (`pipeline`, `generate`, `train`) runs the ones it needs before anything
starts, and `plan` runs them all, so a config is refused at the desk, not hours into a run.

`train` goes further: `resolve_run` decides the whole run once, top down (the settings checked, the
target pinned, the placement, each drafter's shape, start and folder, the memory fit on GPUs), and
the stage and its coordinator execute what it decided (`train.resolved.ResolvedRun`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Iterator

from dflash_ray.config import RunConfig, check_lengths
from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    from dflash_ray.train.devices import Placement
    from dflash_ray.train.resolved import ResolvedRun


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


def _checked(cfg: RunConfig, generating: bool) -> tuple[list[str], list[tuple[str, RunConfig]], Placement]:
    """The settings-only checks (`preflight`): the warnings, each drafter's settings, the placement."""
    from dflash_ray.config import expand_drafters
    from dflash_ray.train.devices import planned_placement
    from dflash_ray.train.shape import check_compiled_shapes

    check_settings(cfg)
    warnings = []
    if generating:
        warning = check_lengths(cfg)
        if warning:
            warnings.append(warning)
    teams = expand_drafters(cfg)
    placement = planned_placement(cfg)
    check_compiled_shapes(cfg, placement, teams)
    return warnings, teams, placement


def preflight(cfg: RunConfig, *, generating: bool = True) -> list[str]:
    """Every settings check a run makes before it starts; returns the warnings (refusals raise).
    `generating`: the run generates its responses (the length rule of generation against tokenization)."""
    return _checked(cfg, generating)[0]


@contextlib.contextmanager
def _naming(name: str) -> Iterator[None]:
    """A drafter's refusal names the drafter (a run of several; the run's one needs no name)."""
    try:
        yield
    except DFlashError as e:
        if not name:
            raise
        raise DFlashError(f"drafter {name!r}: {e}") from None


def resolve_run(target: str, cfg: RunConfig, output: str) -> ResolvedRun:
    """`train`'s run, decided once on the driver before Ray starts, top down: the settings read and
    checked (`preflight`'s checks, the trackers installed), the target pinned (a Hub id: the commit
    every stream actor loads, recorded in the checkpoints), then what follows from them: each
    drafter's shape and start, checked against the target, and on GPUs every role's simulated peak
    against the GPU's memory (`plan`). A bad setting fails here, naming its field (and its drafter)."""
    from dflash_ray import storage
    from dflash_ray.registry import pin
    from dflash_ray.train.resolved import ResolvedDrafter, ResolvedRun
    from dflash_ray.train.shape import check_mask_row, drafter_config, drafter_init
    from dflash_ray.train.trackers import check_installed

    tcfg = cfg.train
    late = [s for s in tcfg.profile_steps if tcfg.max_steps and s > tcfg.max_steps]
    if late:
        print(
            f"dflash-ray train: warning: train.profile_steps {late} are past train.max_steps={tcfg.max_steps}: "
            "no trace of them",
            file=sys.stderr,
        )
    check_installed(tcfg.trackers)
    _, teams, placement = _checked(cfg, generating=False)
    target = pin(target)
    serving = {}
    for name, team in teams:  # the shapes first: the memory fit simulates them
        with _naming(name):
            serving[name] = drafter_config(target, team, placement)
    memory = None
    if tcfg.actor_gpus > 0:
        from dflash_ray.planning import check_memory

        roles = check_memory(cfg, target, serving)
        memory = {role: figures["memory_gb"]["total"] for role, figures in roles.items()}
    starts = {}
    for name, team in teams:
        with _naming(name):
            starts[name] = drafter_init(target, team, serving[name])
            check_mask_row(target, serving[name])
    drafters = tuple(
        ResolvedDrafter(name, team, serving[name], starts[name], storage.join(output, name) if name else output)
        for name, team in teams
    )
    return ResolvedRun(target, cfg, placement, drafters, memory)
