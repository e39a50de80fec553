"""The drafter's shape, decided in one place from the target's config and the `train` settings,
on the driver before any actor starts: a bad setting fails here, naming its field. So do the graphs
its compiled attention will meet over the run (`check_compiled_shapes`)."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from dflash_ray.config import RunConfig
from dflash_ray.drafter.families import mask_and_layer_ids
from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    from dflash_ray.train.devices import Placement


@functools.lru_cache(maxsize=8)
def target_config(target: str):
    """The target's Hugging Face config: the one read of it that every shape decision shares."""
    from dflash_ray import hf_load
    from dflash_ray.registry import config_dir

    return hf_load.config(config_dir(target))


def drafter_config(target: str, cfg: RunConfig, placement: Placement | None = None) -> dict:
    """The drafter's whole shape, in the serving format's config: sizes, vocabulary, RoPE and norms
    from the target; depth, heads, layer types, block and captured layers from `train`; the dtype
    the stream actors will compute in (`placement`, the run's resolved one; else their planned
    placement, checked here too)."""
    return drafter_config_of(target_config(target), cfg, placement)


def drafter_config_of(target_cfg, cfg: RunConfig, placement: Placement | None = None) -> dict:
    """`drafter_config` from the target's config itself (`plan` simulates targets it cannot load)."""
    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import to_hf_config
    from dflash_ray.train.devices import planned_placement

    tcfg = cfg.train
    text = getattr(target_cfg, "text_config", None) or target_cfg
    special = tuple(
        t
        for t in (
            getattr(text, "bos_token_id", None),
            getattr(text, "eos_token_id", None),
            getattr(text, "pad_token_id", None),
        )
        if isinstance(t, int)
    )
    mask_id = (
        tcfg.mask_token_id
        if tcfg.mask_token_id is not None
        else next(i for i in range(text.vocab_size - 1, -1, -1) if i not in special)
    )
    try:
        dcfg = from_target(
            target_cfg,
            mask_token_id=mask_id,
            num_layers=tcfg.num_layers,
            num_target_features=tcfg.num_target_features,
            target_layer_ids=tcfg.target_layer_ids,
            layer_types=tcfg.layer_types,
            sliding_window=tcfg.sliding_window,
            block_size=tcfg.block_size,
            special_token_ids=special,
            num_heads=tcfg.num_heads,
            num_kv_heads=tcfg.num_kv_heads,
            head_dim=tcfg.head_dim,
            intermediate_size=tcfg.intermediate_size,
            family=tcfg.drafter,
            settings=tcfg.family,
        )
    except ValueError as e:  # a drafter shape the target cannot have
        raise DFlashError(str(e), field="train") from None
    return to_hf_config(dcfg, (placement or planned_placement(cfg)).dtype)


def check_mask_row(target: str, drafter_cfg: dict) -> None:
    """Every mask query starts from the mask token's embedding row: a zero (untrained, padding) row
    makes them all the same after the norm. Refused when its norm is near zero against the table's."""
    import torch

    from dflash_ray.registry import resolve
    from dflash_ray.target_model.capture import embedding_rows

    mask_id = mask_and_layer_ids(drafter_cfg)[0]
    vocab = drafter_cfg["vocab_size"]
    sample = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:256].tolist()
    norms = embedding_rows(resolve(target), [mask_id] + sample).norm(dim=-1)
    typical = float(norms[1:].median())
    if float(norms[0]) < 0.05 * typical:
        raise DFlashError(
            f"the embedding row of mask token {mask_id} has norm {float(norms[0]):.3g} against a "
            f"typical {typical:.3g}: an untrained row; choose a trained token",
            field="train.mask_token_id",
        )


def drafter_init(target: str, cfg: RunConfig, serving: dict | None = None) -> str:
    """How the drafter starts ("target", "random", or from a released drafter: `warm_start.PREFIX` and
    its folder), checked on the driver before any actor; `serving`: its `drafter_config`, when resolved."""
    from dflash_ray.drafter import warm_start
    from dflash_ray.drafter.export import from_hf_config
    from dflash_ray.drafter.init import init_mode

    folder = cfg.train.init_from
    if folder:
        run = from_hf_config(serving or drafter_config(target, cfg))
        warm_start.check_fits(warm_start.released_config(folder, run.num_target_layers), run, folder)
        warm_start.check_weights(run, folder)  # here, not in each actor after Ray starts
        return warm_start.PREFIX + folder
    try:
        return init_mode(target_config(target), cfg.train.init)
    except ValueError as e:
        raise DFlashError(str(e), field="train.init") from None


def compiled_shapes(cfg: RunConfig) -> tuple[int, int]:
    """Graphs the drafter's compiled attention meets over a run of one drafter's settings, as (padded
    context lengths, graphs per length): one per length (`tokenize.max_seq_len / train.length_bucket`),
    per attention mask kind of its layers (sliding and full masks are different functions), per grad
    mode (training, and evaluation without gradients when `train.eval_every` is set)."""
    tr = cfg.train
    lengths = math.ceil(cfg.tokenize.max_seq_len / tr.length_bucket)
    return lengths, len(set(tr.layer_types or ["full_attention"])) * (2 if tr.eval_every else 1)


def check_compiled_shapes(cfg: RunConfig, placement: Placement, teams: list[tuple[str, RunConfig]]) -> None:
    """Refuse a drafter (of `teams`, the run's `config.expand_drafters`) whose compiled attention would
    pass its graph limit mid-run (on a new length, hours in, and again after every restart). Only a
    `placement` with flex attention (GPU runs) compiles it."""
    from dflash_ray.drafter.model import MAX_SHAPES

    if placement.attention != "flex":
        return
    keep = cfg.tokenize.max_seq_len
    for name, team in teams:
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
