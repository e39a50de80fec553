"""One training forward of the drafter: anchors → blocks → masks → drafter → loss (no Ray)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from dflash_ray.drafter.blocks import Blocks, bucket_length, dense_mask, flex_block_mask, make_blocks, sample_anchors
from dflash_ray.drafter.loss import LossOutput, acceptance_lengths, dflash_loss
from dflash_ray.drafter.model import DFlashDrafter


@dataclass
class ForwardOutput:
    loss: LossOutput
    blocks: Blocks
    tau: torch.Tensor  # [num_kept] simulated acceptance lengths


def attention_masks(drafter: DFlashDrafter, anchors: torch.Tensor, seq_len: int, attention: str) -> dict:
    cfg = drafter.cfg
    build = dense_mask if attention == "sdpa" else flex_block_mask
    return {t: build(anchors, seq_len, cfg.block_size, t, cfg.sliding_window) for t in set(cfg.layer_types)}


def pad_positions(length: int, *tensors_BS: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor [B, S, ...] right-padded with zeros to `length` positions."""
    out = []
    for t in tensors_BS:
        pad = [0, 0] * (t.dim() - 2) + [0, length - t.shape[1]]
        out.append(F.pad(t, pad))
    return out


def pad_to_bucket(
    length_bucket: int,
    features_BSF: torch.Tensor,
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    teacher: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None,
):
    """A batch's positions padded up to a multiple of `length_bucket` (loss_mask 0 there)."""
    padded = bucket_length(input_ids_BS.shape[1], length_bucket)
    if padded > input_ids_BS.shape[1]:
        features_BSF, input_ids_BS, loss_mask_BS = pad_positions(padded, features_BSF, input_ids_BS, loss_mask_BS)
        if isinstance(teacher, torch.Tensor):  # a target's last hidden states
            teacher = pad_positions(padded, teacher)[0]
        elif teacher is not None:
            teacher = cast("tuple[torch.Tensor, torch.Tensor]", tuple(pad_positions(padded, *teacher)))
    return features_BSF, input_ids_BS, loss_mask_BS, teacher


@dataclass
class Drafted:
    """The first half of every family's training forward (`draft_blocks`)."""

    hidden_BQH: torch.Tensor  # the drafter's final-normed hidden states of the blocks
    blocks: Blocks
    input_ids_BS: torch.Tensor  # the batch as padded to its length bucket
    teacher: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None  # likewise


def draft_blocks(
    drafter: DFlashDrafter,
    embed_VH: torch.Tensor,
    features_BSF: torch.Tensor,
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    *,
    num_anchors: int,
    generator: torch.Generator | None,
    attention: str,
    gamma: float | None,
    teacher: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None,
    distill: float,
    length_bucket: int,
    first_prediction: int = 1,
    anchor_seeds: torch.Tensor | None = None,
) -> Drafted:
    """Padding to the length bucket, anchors, blocks (labels and weights for `first_prediction`;
    distillation's soft targets when `distill` > 0), and the drafter's pass over them. `anchor_seeds`
    [B]: each row's anchors drawn from its own seed (`blocks.sample_anchors`); None: from `generator`."""
    cfg = drafter.cfg
    features_BSF, input_ids_BS, loss_mask_BS, teacher = pad_to_bucket(
        length_bucket, features_BSF, input_ids_BS, loss_mask_BS, teacher
    )
    seeds = None if anchor_seeds is None else [int(x) for x in anchor_seeds.tolist()]
    anchors, keep = sample_anchors(loss_mask_BS, num_anchors, generator, seeds)
    blocks = make_blocks(
        input_ids_BS,
        loss_mask_BS,
        anchors,
        keep,
        mask_token_id=cfg.mask_token_id,
        block_size=cfg.block_size,
        gamma=gamma,
        teacher=teacher if distill > 0 and isinstance(teacher, tuple) else None,
        distill=distill,
        first_prediction=first_prediction,
    )
    block_embeds = F.embedding(blocks.token_ids, embed_VH).to(features_BSF.dtype)
    masks = attention_masks(drafter, anchors, input_ids_BS.shape[1], attention)
    hidden = drafter(features_BSF, block_embeds, blocks.positions, masks)
    return Drafted(hidden, blocks, input_ids_BS, teacher)


def forward_loss(
    drafter: DFlashDrafter,
    embed_VH: torch.Tensor,
    head_VH: torch.Tensor,
    features_BSF: torch.Tensor,
    input_ids_BS: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    *,
    num_anchors: int,
    generator: torch.Generator | None = None,
    attention: str = "sdpa",
    fused: bool = True,
    gamma: float | None = None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
    distill: float = 0.0,
    length_bucket: int = 1,
    anchor_seeds: torch.Tensor | None = None,
) -> ForwardOutput:
    """`teacher`: the target's top-k next-token ids and probabilities [B, S, k] (`target_outputs`);
    `distill`: the share of each position's target they carry (the label carries the rest);
    `length_bucket`: the context is padded to a multiple of it (loss_mask 0 there, so the loss and
    the anchors drawn are those of the unpadded batch) to bound the shapes attention sees;
    `anchor_seeds` [B]: each row's own anchor seed (`draft_blocks`; None: `generator` draws them)."""
    drafted = draft_blocks(
        drafter,
        embed_VH,
        features_BSF,
        input_ids_BS,
        loss_mask_BS,
        num_anchors=num_anchors,
        generator=generator,
        attention=attention,
        gamma=gamma,
        teacher=teacher,
        distill=distill,
        length_bucket=length_bucket,
        anchor_seeds=anchor_seeds,
    )
    blocks = drafted.blocks
    out = dflash_loss(
        drafted.hidden_BQH,
        head_VH,
        blocks.labels,
        blocks.weights,
        fused=fused,
        soft_ids_BQm=blocks.soft_ids,
        soft_probs_BQm=blocks.soft_probs,
    )
    tau = acceptance_lengths(out.correct, blocks.weights, blocks.keep, drafter.cfg.block_size)
    return ForwardOutput(out, blocks, tau)
