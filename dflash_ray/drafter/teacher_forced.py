"""What greedy speculative decoding would accept from a block drafted at each answer position,
read off one training forward over the target's own answer (no decoding loop, no Ray).

Greedy decoding accepts a block's drafts while each equals the target's greedy token, and the
target's greedy answer is the sequence itself; so a block anchored at position a, drafted from the
same context features serving gives it, accepts exactly its leading run of hits on the sequence's
tokens. Real decoding anchors its blocks where the previous one ended; here every answer position
anchors one, so a recipe is scored on all of them at the cost of one forward.
"""

from __future__ import annotations

import torch

from dflash_ray.drafter import families


@torch.no_grad()
def blocks_accepted(
    drafter, embed_VH: torch.Tensor, head_VH: torch.Tensor, features_BSF, input_ids_BS, loss_mask_BS
) -> list[tuple[int, int, int]]:
    """(anchor position, drafts with a token to meet, drafts accepted in a row) for every anchor of
    the batch's answers (sequence by sequence, anchors ascending). A block near the answer's end has
    fewer drafts to meet than the block holds."""
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
    )
    blocks = out.blocks
    valid = (blocks.weights > 0).view(-1, K)[:, first:]
    hit = out.loss.correct.view(-1, K)[:, first:] & valid
    accepted = hit.long().cumprod(-1).sum(-1)
    drafted = valid.sum(-1)
    keep = blocks.keep.reshape(-1)
    anchors = blocks.anchors.reshape(-1)
    return [(int(a), int(d), int(n)) for a, d, n, k in zip(anchors, drafted, accepted, keep) if k]
