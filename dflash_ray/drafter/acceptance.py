"""Acceptance length measured for real, prompt by prompt, and gathered into `evaluate`'s figures.

Each prompt that fits the target's positions is decoded by the target alone (greedy: the reference,
kept across calls in a cache), with the drafter (speculative decoding; it must give the reference
token for token), by n-gram prompt lookup simulated on the same reference, and at the serving
temperature under the speculative-sampling rule: every figure of one prompt comes from one
reference output. `summarize` puts the drafter's tau beside prompt lookup's; `heldout_tau` is the
simulated tau that training reports, on a tokenized held-out set; `add_vllm` adds vLLM's own.
torch is imported inside the functions, so the CLI that lists the stages does not load it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from typing import Any

from dflash_ray import manifest
from dflash_ray.config import RunConfig
from dflash_ray.drafter.evaluation_models import Models
from dflash_ray.drafter.vllm_check import vllm_decode
from dflash_ray.errors import DFlashError

log = logging.getLogger(__name__)


def prompt_rows(uri: str, limit: int) -> list[dict[str, Any]]:
    """The prompts to measure on. A conversation that generation answers turn by turn is measured on
    its first turn: its later turns need the target's own earlier answers in the history."""
    from dflash_ray.generation.completions import Conversation

    rows = manifest.read_rows(uri, None, limit)  # all columns: `regenerate` is absent from older shards
    if not rows:
        raise DFlashError("no prompts", file=uri)
    return [{**row, "messages": Conversation.of(row).history} for row in rows]


def within_context(
    rows: list[dict[str, Any]], tokenizer, ecfg, context: int | None, prompts_uri: str
) -> tuple[list[tuple[dict[str, Any], list[int]]], list[int]]:
    """Each row with its prompt's tokens, those whose decoding fits the target's `context` positions
    (the prompt and `evaluate.max_new_tokens`), and the lengths of those that do not: every prompt is
    measured before any decoding, and what is left out is said, not decoded for minutes past the
    positions the target was made for."""
    kept, skipped = [], []
    for row in rows:
        tools = json.loads(row["tools"]) if row.get("tools") else None
        text = tokenizer.apply_chat_template(
            row["messages"],
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=ecfg.enable_thinking,
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if context is not None and len(ids) + ecfg.max_new_tokens > context:
            skipped.append(len(ids))
        else:
            kept.append((row, ids))
    if skipped:
        what = (
            f"{len(skipped)} of {len(rows)} prompts (up to {max(skipped)} tokens) with evaluate.max_new_tokens="
            f"{ecfg.max_new_tokens} pass the target's {context} positions (its max_position_embeddings)"
        )
        if not kept:
            raise DFlashError(
                f"{what}: none is left to measure; lower evaluate.max_new_tokens or give shorter prompts",
                file=prompts_uri,
                field="evaluate.max_new_tokens",
            )
        log.warning("%s: skipped, not decoded (the summary's prompts_skipped)", what)
    return kept, skipped


@dataclasses.dataclass
class Tally:
    """What decoding the prompts measured, gathered prompt by prompt for the summary."""

    per_source: dict[str, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    ngram_per_source: dict[str, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    all_steps: list[int] = dataclasses.field(default_factory=list)
    sampled_steps: list[int] = dataclasses.field(default_factory=list)
    ngram_steps: list[Any] = dataclasses.field(default_factory=list)
    prompt_ids: list[list[int]] = dataclasses.field(default_factory=list)
    references: list[list[int]] = dataclasses.field(default_factory=list)
    verified: list[Any] = dataclasses.field(default_factory=list)  # (drafted, accepted) per verify step
    verified_sampled: list[Any] = dataclasses.field(default_factory=list)
    spec_s: float = 0.0
    base_s: float = 0.0
    tokens: int = 0
    mismatches: int = 0


def decode_prompts(
    models: Models, encoded: list[tuple[dict[str, Any], list[int]]], ecfg, target_uri: str, sampled: bool, cache: dict
) -> Tally:
    """Each prompt decoded by the target alone (or taken from `cache`), with the drafter, by prompt
    lookup on the same output, and at the serving temperature: every figure of one prompt comes
    from the same reference output."""
    import torch
    from tqdm import tqdm

    from dflash_ray.drafter import ngram
    from dflash_ray.drafter.speculative import Sampling, speculative_decode, target_decode

    tally = Tally()
    generator = torch.Generator(device=models.device).manual_seed(ecfg.seed)
    for row, ids in tqdm(encoded, desc="evaluate", unit=" prompts"):
        tally.prompt_ids.append(ids)
        key = (target_uri, ecfg.max_new_tokens, tuple(ids))
        if key not in cache:
            cache[key] = target_decode(models.target, ids, ecfg.max_new_tokens, models.eos)
        ref = cache[key]
        tally.references.append(ref.token_ids)
        spec = speculative_decode(
            models.target, models.drafter, models.embed, models.head, ids, ecfg.max_new_tokens, models.eos
        )
        tally.mismatches += int(spec.token_ids != ref.token_ids)
        tally.per_source[row["source"]] += spec.acceptance
        tally.all_steps += spec.acceptance
        tally.verified += spec.verified
        lookup = ngram.simulate_steps(ids, ref.token_ids, models.num_drafts, ecfg.ngram_min, ecfg.ngram_max)
        tally.ngram_steps += lookup
        tally.ngram_per_source[row["source"]] += [step.commit for step in lookup]
        if sampled and ecfg.temperature > 0:  # at the serving temperature: the speculative-sampling rule
            sampling = Sampling(ecfg.temperature, ecfg.top_p, generator)
            drawn = speculative_decode(
                models.target, models.drafter, models.embed, models.head, ids, ecfg.max_new_tokens, models.eos, sampling
            )
            tally.sampled_steps += drawn.acceptance
            tally.verified_sampled += drawn.verified
        tally.spec_s += spec.seconds
        tally.base_s += ref.seconds
        tally.tokens += len(ref.token_ids)
    return tally


def _mean(xs):
    return round(sum(xs) / len(xs), 4) if xs else None


def summarize(
    tally: Tally, drafter_uri: str, target_uri: str, device: str, prompts: int, skipped: int, context, ecfg
) -> dict[str, Any]:
    """The figures of every prompt together; the drafter's tau beside prompt lookup's on the same outputs."""
    from dflash_ray.drafter.speculative import acceptance_by_position

    ngram_steps = tally.ngram_steps
    return {
        "stage": "evaluate",
        "drafter": drafter_uri,
        "target": target_uri,
        "device": device,
        "prompts": prompts,
        # prompts whose tokens and evaluate.max_new_tokens pass the target's positions: not decoded
        "prompts_skipped": skipped,
        "context": context,
        "tokens": tally.tokens,
        "tau": _mean(tally.all_steps),
        "verify_steps": len(tally.all_steps),
        "tau_per_source": {s: _mean(v) for s, v in sorted(tally.per_source.items())},
        "acceptance_by_position": acceptance_by_position(tally.verified),
        "tau_sampled": _mean(tally.sampled_steps),
        "acceptance_by_position_sampled": acceptance_by_position(tally.verified_sampled),
        "sampling": {"temperature": ecfg.temperature, "top_p": ecfg.top_p},
        "tau_ngram": _mean([step.commit for step in ngram_steps]),
        "tau_ngram_per_source": {s: _mean(v) for s, v in sorted(tally.ngram_per_source.items())},
        "ngram_acceptance_by_position": acceptance_by_position(
            [(s.drafted, s.accepted) for s in ngram_steps if s.drafted]
        ),
        "tau_ngram_per_draft": _mean([step.commit for step in ngram_steps if step.drafted]),
        "ngram_draft_share": round(sum(s.drafted > 0 for s in ngram_steps) / len(ngram_steps), 4)
        if ngram_steps
        else None,
        "tokens_per_s": round(tally.tokens / tally.spec_s, 2) if tally.spec_s else None,
        "target_tokens_per_s": round(tally.tokens / tally.base_s, 2) if tally.base_s else None,
        "speedup": round(tally.base_s / tally.spec_s, 3) if tally.spec_s else None,
        "lossless": tally.mismatches == 0,
        "mismatched_prompts": tally.mismatches,
    }


def heldout_tau(models: Models, uri: str, cfg: RunConfig) -> float | None:
    """The simulated tau on a tokenized held-out set: the figure training reports, for comparison."""
    import torch

    from dflash_ray.drafter import families
    from dflash_ray.target_model.capture import target_features

    ecfg, drafter, embed, head = cfg.evaluate, models.drafter, models.embed, models.head
    forward_loss = families.get(drafter.cfg.family).forward_loss
    taus: list[float] = []
    g = torch.Generator().manual_seed(ecfg.seed)
    for row in manifest.read_rows(uri, ["input_ids", "loss_mask"], ecfg.num_heldout):
        ids = torch.tensor([row["input_ids"]], device=head.device)
        mask = torch.tensor([row["loss_mask"]], device=head.device)
        feats = target_features(models.target, ids, drafter.cfg.target_layer_ids)
        with torch.no_grad():
            out = forward_loss(
                drafter, embed, head, feats.to(embed.dtype), ids, mask, num_anchors=ecfg.num_anchors, generator=g
            )
        taus += out.tau.tolist()
    return sum(taus) / len(taus) if taus else None


def add_vllm(summary: dict[str, Any], models: Models, tally: Tally, ecfg) -> None:
    """vLLM's own acceptance on the same prompts, and whether it decodes the target's outputs."""
    result = vllm_decode(
        models.target_dir, models.drafter_dir, tally.prompt_ids, ecfg.max_new_tokens, ecfg.temperature, ecfg.top_p
    )
    summary["tau_vllm"] = result["acceptance_length"]
    summary["tau_vllm_sampled"] = result.get("sampled", {}).get("acceptance_length")
    summary["vllm_outputs_equal"] = result["outputs"] == tally.references
