"""What greedy speculative decoding would accept from a block drafted at each answer position,
read off one training forward over the target's own answer (no decoding loop, no Ray).

Greedy decoding accepts a block's drafts while each equals the target's greedy token, and the
target's greedy answer is the sequence itself; so a block anchored at position a, drafted from the
same context features serving gives it, accepts exactly its leading run of hits on the sequence's
tokens. Every answer position anchors one block (`blocks_accepted`), at the cost of one forward;
`walk` then picks the blocks real decoding verifies (each anchored where the previous one's
committed tokens end), so the figures are those of `speculative.speculative_decode` itself, block
for block, without its one-target-forward-per-block loop.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_ray.drafter import families
from dflash_ray.drafter.speculative import acceptance_by_position


@torch.no_grad()
def blocks_by_row(
    drafter,
    embed_VH: torch.Tensor,
    head_VH: torch.Tensor,
    features_BSF,
    input_ids_BS,
    loss_mask_BS,
    attention: str = "sdpa",
) -> list[dict[int, tuple[int, int]]]:
    """Per sequence, {anchor position: (drafts with a token to meet, drafts accepted in a row)} for
    every anchor of its answers, ascending. A block near an answer's end has fewer drafts to meet
    than the block holds: the run of its drafts whose tokens lie inside that answer."""
    family = families.get(drafter.cfg.family)
    K, first = drafter.cfg.block_size, family.first_prediction
    out = family.forward_loss(
        drafter,
        embed_VH,
        head_VH,
        features_BSF,
        input_ids_BS,
        loss_mask_BS,
        num_anchors=int(loss_mask_BS.sum(1).max()),  # every anchor of the longest answer
        generator=torch.Generator().manual_seed(0),
        attention=attention,
    )
    blocks = out.blocks
    B, A = blocks.anchors.shape
    # a draft past its answer's end (into the next turn's prompt or answer) is never verified there
    valid = (blocks.weights > 0).view(B, A, K)[..., first:].long().cumprod(-1).bool()
    hit = out.loss.correct.view(B, A, K)[..., first:] & valid
    accepted = hit.long().cumprod(-1).sum(-1).tolist()
    drafted = valid.sum(-1).tolist()
    anchors, keep = blocks.anchors.tolist(), blocks.keep.tolist()
    return [{anchors[b][j]: (drafted[b][j], accepted[b][j]) for j in range(A) if keep[b][j]} for b in range(B)]


def blocks_accepted(
    drafter,
    embed_VH: torch.Tensor,
    head_VH: torch.Tensor,
    features_BSF,
    input_ids_BS,
    loss_mask_BS,
    attention: str = "sdpa",
) -> list[tuple[int, int, int]]:
    """(anchor position, drafts with a token to meet, drafts accepted in a row) for every anchor of
    the batch's answers (sequence by sequence, anchors ascending): `blocks_by_row`, flat."""
    rows = blocks_by_row(drafter, embed_VH, head_VH, features_BSF, input_ids_BS, loss_mask_BS, attention)
    return [(a, d, n) for row in rows for a, (d, n) in row.items()]


@dataclass
class Walk:
    """The blocks greedy speculative decoding verifies, as `speculative.Generation` reports them:
    `verified` (drafts, drafts accepted) per block, before the answer's end cuts them; `acceptance`
    the tokens each block commits (accepted + 1, cut at the answer's end)."""

    verified: list[tuple[int, int]] = field(default_factory=list)
    acceptance: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(len(self.acceptance), 1)


def walk(blocks: Mapping[int, tuple[int, int]], start: int, length: int) -> Walk:
    """The blocks decoding verifies over an answer of `length` tokens at positions start.. (what it
    generates: the answer cut at max_new_tokens and after its first end-of-sequence token). The first
    token is the target's at prefill, so the first block is anchored on it; a block that accepts n
    drafts commits them and the target's bonus token, and the next is anchored on that bonus.

    A block's (drafts, accepted) are those of `blocks` (`blocks_by_row`): equal to decoding's when
    the known answer runs a whole block past `length` (the target verifies drafts past the cap and
    past end-of-sequence too); a block whose drafts run past the known answer reports the part it
    could check. `acceptance` is decoding's either way."""
    out = Walk()
    committed = 1
    while committed < length:
        drafted, accepted = blocks[start + committed - 1]
        out.verified.append((drafted, accepted))
        out.acceptance.append(min(accepted + 1, length - committed))
        committed += out.acceptance[-1]
    return out


def answers(loss_mask_S: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of loss-mask 1: one answer each (a multi-turn sample's turns)."""
    spans, start = [], None
    for i, m in enumerate([*loss_mask_S, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def walks(
    drafter,
    embed_VH: torch.Tensor,
    head_VH: torch.Tensor,
    features_BSF,
    input_ids_BS,
    loss_mask_BS,
    *,
    max_new_tokens: int | None = None,
    eos_ids: Collection[int] = (),
    attention: str = "sdpa",
) -> list[Walk]:
    """Per sequence, the blocks greedy speculative decoding with `max_new_tokens` and `eos_ids`
    verifies over its answers (each answer decoded from the context before it, its blocks appended
    in order), from one forward. The answers must be the target's own greedy ones."""
    rows = blocks_by_row(drafter, embed_VH, head_VH, features_BSF, input_ids_BS, loss_mask_BS, attention)
    eos = set(eos_ids)
    out = []
    for blocks, ids, mask in zip(rows, input_ids_BS.tolist(), loss_mask_BS.tolist()):
        row = Walk()
        for start, end in answers(mask):
            length = end - start if max_new_tokens is None else min(end - start, max_new_tokens)
            stop = next((i + 1 for i, t in enumerate(ids[start : start + length]) if t in eos), length)
            one = walk(blocks, start, stop)
            row.verified += one.verified
            row.acceptance += one.acceptance
        out.append(row)
    return out


def position_counts(verified: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Per draft position k (1 = the first): (blocks that drafted it with every position before it
    accepted, those that accepted it). `speculative.acceptance_by_position` is their ratio; counts
    add over prompts and seeds, where rates do not."""
    positions = max((d for d, _ in verified), default=0)
    counts = []
    for k in range(1, positions + 1):
        reached = [a for d, a in verified if d >= k and a >= k - 1]
        counts.append((len(reached), sum(a >= k for a in reached)))
    return counts


def summary(walks: list[Walk]) -> dict[str, Any]:
    """Each prompt's tau; tau of them all (committed tokens over blocks, not the mean of the prompts'
    taus, which would weigh a short answer's few blocks as much as a long one's many); acceptance by
    draft position over every block, as rates and as counts."""
    verified = [v for w in walks for v in w.verified]
    blocks = sum(len(w.acceptance) for w in walks)
    return {
        "tau_per_prompt": [w.tau for w in walks],
        "tau": sum(sum(w.acceptance) for w in walks) / max(blocks, 1),
        "blocks": blocks,
        "by_position": acceptance_by_position(verified),
        "position_counts": position_counts(verified),
    }
