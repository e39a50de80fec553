"""The target and the drafter an evaluation decodes with, loaded once for every prompt.

`load_models` puts both on the evaluation's device (`evaluation_device`) in `evaluate.dtype`, with the
target's tokenizer, embedding, head and stop tokens, and refuses a drafter or tokenizer made for
another target: it would decode, but what it measured would mean nothing. torch and transformers are
imported inside the functions, so the CLI that lists the stages loads neither.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_ray.errors import DFlashError


def evaluation_device(setting: str, cuda_available: bool) -> str:
    """`auto`: the GPU when this process sees one (the target, drafter and decoding loop all go there)."""
    if setting == "cuda" and not cuda_available:
        raise DFlashError("evaluate.device=cuda but CUDA sees no GPU here", field="evaluate.device")
    return "cuda" if setting == "cuda" or (setting == "auto" and cuda_available) else "cpu"


@dataclasses.dataclass
class Models:
    """The target, the drafter and what decoding needs of them, loaded once for every prompt."""

    device: str
    target_dir: str
    drafter_dir: str
    tokenizer: Any
    drafter: Any
    target: Any
    text_cfg: Any
    embed: Any
    head: Any
    eos: set[int]
    num_drafts: int  # the n-gram baseline drafts as many tokens a step as the drafter does


def load_models(drafter_uri: str, target_uri: str, tokenizer_name: str | None, ecfg) -> Models:
    import torch

    from dflash_ray import hf_load
    from dflash_ray.drafter import families
    from dflash_ray.drafter.export import load_drafter
    from dflash_ray.registry import load_tokenizer, resolve, stop_token_ids
    from dflash_ray.target_model.capture import load_embed_and_head

    dtype = getattr(torch, ecfg.dtype)
    device = evaluation_device(ecfg.device, torch.cuda.is_available())
    target_dir, drafter_dir = resolve(target_uri), resolve(drafter_uri)
    refuse_drafter_as_target(target_dir, target_uri)
    tokenizer = load_tokenizer(tokenizer_name or target_uri)
    # transformers types its wrapped `to` as if unbound (the model first)
    try:
        drafter = load_drafter(drafter_dir).to(device, dtype).eval()
    except ValueError as e:  # no drafter family's config.json, or weights that do not fit it
        raise DFlashError(f"not a drafter this project exports: {e}", file=drafter_uri) from None
    target = hf_load.causal_lm(target_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    text_cfg = target.config.get_text_config()
    check_same_target(drafter, target, text_cfg, tokenizer, drafter_uri)
    embed, head = (t.to(device, dtype) for t in load_embed_and_head(target_dir))
    num_drafts = drafter.cfg.block_size - families.get(drafter.cfg.family).first_prediction
    return Models(
        device=device,
        target_dir=target_dir,
        drafter_dir=drafter_dir,
        tokenizer=tokenizer,
        drafter=drafter,
        target=target,
        text_cfg=text_cfg,
        embed=embed,
        head=head,
        eos=set(stop_token_ids(tokenizer)),
        num_drafts=num_drafts,
    )


def refuse_drafter_as_target(target_dir: str, target_uri: str) -> None:
    """A drafter export named as the target loads as a model of the target's kind with its weights
    mostly missing, and then reads as a drafter of another target: said here, naming `--target`."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):  # no readable config.json: the model's own loading names that
        return
    if not isinstance(config, dict):
        return
    architectures = config.get("architectures")
    named = [a for a in architectures if isinstance(a, str)] if isinstance(architectures, list) else []
    if "dflash_config" in config or any(a.endswith("DraftModel") for a in named):
        raise DFlashError(
            f"a drafter export, not a target model (its config.json: {', '.join(named) or 'dflash_config'}): give "
            "the model the drafter drafts for as --target, and the export as --drafter",
            file=target_uri,
            field="--target",
        )


def check_same_target(drafter, target, text_cfg, tokenizer, drafter_uri: str) -> None:
    """A drafter or tokenizer of another target decodes, but what it measures means nothing."""
    rows_of_embedding = target.get_input_embeddings().num_embeddings
    theirs = {k: getattr(text_cfg, k, None) for k in ("vocab_size", "hidden_size")}
    theirs["num_target_layers"] = getattr(text_cfg, "num_hidden_layers", None)
    wrong = [
        f"{k} {getattr(drafter.cfg, k)} (the target's: {v})" for k, v in theirs.items() if v != getattr(drafter.cfg, k)
    ]
    if wrong:
        raise DFlashError(f"a drafter of another target: its config.json gives {', '.join(wrong)}", file=drafter_uri)
    if len(tokenizer) > rows_of_embedding:
        raise DFlashError(
            f"the tokenizer has {len(tokenizer)} ids, past the target's {rows_of_embedding}-entry "
            "embedding: it is not the target's",
            field="--tokenizer",
        )
