"""Speculative decoding with a drafter against a Hugging Face target (no Ray).

Each step the drafter proposes drafts `d_1..d_D` after the last committed token by its family's rule
(DFlash: K - 1 at once from one non-causal pass; DSpark: K, left to right over one pass), the target
verifies `[last, d_1..d_D]` in one forward, and the accepted drafts are committed plus one token of
the target's own (the bonus). The drafter's context grows by the target's hidden states of the
committed tokens. Acceptance length per step = accepted drafts + 1.

Greedy (temperature 0): a draft is accepted while it equals the target's greedy choice, and the
output equals the target's own greedy output token for token. Sampled (temperature T, top-p): the
drafts come from the drafter's distribution q (its argmax, q one-hot, as vLLM drafts; or sampled
from its warped distribution), draft d_k is accepted with probability min(1, p_k(d_k) / q_k(d_k)),
the first rejected position resamples from norm(max(0, p_k - q_k)), and the output is distributed
exactly as the target's own warped samples (tested statistically, both ways of drafting).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dflash_ray.drafter import families
from dflash_ray.target_model.capture import capture

if TYPE_CHECKING:
    from dflash_ray.drafter.model import DFlashDrafter


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens (prompt excluded)
    acceptance: list[int] = field(default_factory=list)  # tokens committed per verify step
    seconds: float = 0.0
    # per verify step: (drafts proposed, drafts the target accepted), before the answer's end cuts them
    verified: list[tuple[int, int]] = field(default_factory=list)
    # the target's features the drafter was given, one row per token the target processed [1, n, F]
    # (speculative decoding only): what serving feeds it, to hold against what training fed it
    context: torch.Tensor | None = None

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(len(self.acceptance), 1)


def acceptance_by_position(verified: list[tuple[int, int]]) -> list[float | None]:
    """Per draft position k (1 = the first draft): the share of verify steps that accepted it among
    those that drafted it and accepted every position before it. Their running product is the
    chance a block gets that far: the suffix decay a family's later positions are meant to lift."""
    positions = max((d for d, _ in verified), default=0)
    rates: list[float | None] = []
    for k in range(1, positions + 1):
        reached = [a for d, a in verified if d >= k and a >= k - 1]
        rates.append(round(sum(a >= k for a in reached) / len(reached), 4) if reached else None)
    return rates


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else sampled from the warped distribution.
    `greedy_drafts`: under sampling the drafter still proposes its argmax (q is one-hot there), as
    vLLM's DFlash proposer does; otherwise drafts are sampled from its warped distribution. Both
    keep the output distributed as the target's; they differ in how often drafts are accepted."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None  # on the target's device
    greedy_drafts: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Probabilities [..., V] at `temperature`, keeping the smallest set of tokens whose mass
    reaches `top_p` (the token that crosses it included), renormalized."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros(()))
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def _choose(logits: torch.Tensor, sampling: Sampling) -> int:
    if sampling.greedy:
        return int(logits.argmax())
    probs = warp(logits, sampling.temperature, sampling.top_p)
    return int(torch.multinomial(probs, 1, generator=sampling.generator))


def has_recurrent_layers(target) -> bool:
    """A hybrid target (Qwen3.5/3.6: Gated-DeltaNet layers) carries a recurrent state in its cache."""
    types = getattr(target.config.get_text_config(decoder=True), "layer_types", None) or []
    return any(t not in ("full_attention", "sliding_attention") for t in types)


@torch.no_grad()
def target_decode(
    target, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int], sampling: Sampling = Sampling()
) -> Generation:
    """The target alone, one token per forward, with its KV cache: the reference (greedy, or
    sampled with `sampling`)."""
    from transformers import DynamicCache

    start = time.perf_counter()
    device = target.device
    cache = DynamicCache(config=target.config)  # a hybrid target's recurrent layers need their own cache
    ids = torch.tensor([prompt_ids], device=device)
    out_tokens: list[int] = []
    while len(out_tokens) < max_new_tokens:
        logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        token = _choose(logits, sampling)
        out_tokens.append(token)
        if token in eos_ids:
            break
        ids = torch.tensor([[token]], device=device)
    return Generation(out_tokens, seconds=time.perf_counter() - start)


def verify_sampled(
    drafts: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """The speculative-sampling rule over one block: `drafts` [D] drawn from `q` [D, V] (None: q
    one-hot on the drafts, never built); `p` [D + 1, V] the target's warped distributions after each
    block token. Returns (accepted drafts, the token that follows them: a residual sample at the
    first rejection, else a bonus sample)."""
    D = drafts.numel()
    rows = torch.arange(D, device=drafts.device)
    q_drafts = q[rows, drafts].clamp_min(1e-30) if q is not None else 1.0
    ratio = (p[rows, drafts] / q_drafts).clamp(max=1.0)
    u = torch.rand(D, device=drafts.device, generator=generator)
    rejected = (u >= ratio).nonzero()
    if rejected.numel() == 0:
        return D, int(torch.multinomial(p[D], 1, generator=generator))
    k = int(rejected[0])
    if q is not None:
        residual = (p[k] - q[k]).clamp_min(0)
    else:  # max(0, p - onehot(d)) is p without d
        residual = p[k].clone()
        residual[drafts[k]] = 0
    if float(residual.sum()) <= 0:  # p == q there: rejection had probability 0; sample p
        residual = p[k]
    return k, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


@torch.no_grad()
def speculative_decode(
    target,
    drafter: DFlashDrafter,
    embed_VH: torch.Tensor,
    head_VH: torch.Tensor,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling = Sampling(),
) -> Generation:
    """Speculative decoding, greedy by default; with a sampling `sampling` the speculative-sampling
    rule (the output is distributed as the target's own samples)."""
    from transformers import DynamicCache

    family = families.get(drafter.cfg.family)
    layer_ids = drafter.cfg.target_layer_ids
    start = time.perf_counter()
    device = target.device  # the drafter, embedding and head live beside the target
    cache = DynamicCache(config=target.config)
    recurrent = has_recurrent_layers(target)
    with capture(target, layer_ids, stop_after_last=False) as captured:
        logits = target(
            input_ids=torch.tensor([prompt_ids], device=device), past_key_values=cache, use_cache=True
        ).logits
        context = torch.cat([captured[i] for i in layer_ids], -1)  # [1, n, F]
    out_tokens = [_choose(logits[0, -1], sampling)]
    acceptance: list[int] = []
    verified: list[tuple[int, int]] = []
    while len(out_tokens) < max_new_tokens and out_tokens[-1] not in eos_ids:
        n = context.shape[1]  # committed tokens the target has processed; the last one has not
        drafts, q = family.propose(drafter, context, out_tokens[-1], embed_VH, head_VH, sampling)
        block_ids = torch.cat([torch.tensor([out_tokens[-1]], device=device), drafts.to(device)])[None]
        positions = torch.arange(n, n + block_ids.shape[1], device=device)[None]
        before = copy.deepcopy(cache) if recurrent else None  # a recurrent state cannot be cropped
        with capture(target, layer_ids, stop_after_last=False) as captured:
            logits = target(input_ids=block_ids, past_key_values=cache, use_cache=True, position_ids=positions).logits[
                0
            ]
            feats = torch.cat([captured[i] for i in layer_ids], -1)
        if sampling.greedy:
            greedy = logits.argmax(-1)  # greedy[i]: the target's choice after block token i
            accepted = int((drafts == greedy[:-1]).long().cumprod(0).sum())
            following = int(greedy[accepted])
        else:
            p = warp(logits, sampling.temperature, sampling.top_p)
            accepted, following = verify_sampled(drafts, q, p, sampling.generator)
        verified.append((len(drafts), accepted))
        new = drafts[:accepted].tolist() + [following]
        room = max_new_tokens - len(out_tokens)
        new = new[:room]
        for i, token in enumerate(new):  # stop at the first end-of-sequence token
            if token in eos_ids:
                new = new[: i + 1]
                break
        out_tokens += new
        acceptance.append(len(new))
        # the target processed block tokens 0..accepted; keep their cache and features only (features
        # are causal: the rejected tokens after them changed none)
        if recurrent:  # back to the state before the block, then forward through the kept tokens only
            assert before is not None  # copied above for a recurrent target
            cache = before
            target(
                input_ids=block_ids[:, : accepted + 1],
                past_key_values=cache,
                use_cache=True,
                position_ids=positions[:, : accepted + 1],
            )
        else:
            cache.crop(n + accepted + 1)
        context = torch.cat([context, feats[:, : accepted + 1]], dim=1)
    return Generation(out_tokens, acceptance, time.perf_counter() - start, verified, context)
