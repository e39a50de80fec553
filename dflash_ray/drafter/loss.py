"""The DFlash loss, per-position accuracy and the simulated acceptance length.

Loss = sum(w * CE) / sum(w) over block positions, with the weights of `blocks.make_blocks`
(decayed with k, zero at k = 0, on loss-masked labels only). The CE is against the hard label, or
with `train.distill` against a mix of the label and the target's own top-k next-token distribution
(`blocks.soft_targets`): CE(t, z) = logsumexp(z) - sum_j t_j z_j, whose gradient is softmax(z) - t.

Simulated acceptance length of a block: consecutive correct top-1 predictions from k = 1 until
the first miss, plus one (the bonus token the target always adds). A position whose label is
outside the response (weight 0) ends the run, since nothing past it would be verified. tau is the
mean over kept blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # [B, Q] bool: top-1 == label
    weight_sum: torch.Tensor  # scalar: sum of weights (for averaging across streams)


def naive_loss(
    hidden_NH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_N: torch.Tensor,
    weights_N: torch.Tensor,
    soft_ids_Nm: torch.Tensor | None = None,
    soft_probs_Nm: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: materializes the full [N, V] fp32 logits. Returns (loss, correct[N])."""
    logits = hidden_NH.float() @ lm_head_VH.float().t()
    if soft_ids_Nm is None:
        ce = F.cross_entropy(logits, labels_N, reduction="none")
    else:
        assert soft_probs_Nm is not None  # given with the ids
        target = torch.zeros_like(logits).scatter_add_(1, soft_ids_Nm, soft_probs_Nm.float())
        ce = -(target * torch.log_softmax(logits, -1)).sum(-1)
    loss = (ce * weights_N).sum() / weights_N.sum().clamp_min(1e-12)
    return loss, logits.argmax(-1) == labels_N


def dflash_loss(
    hidden_BQH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_BQ: torch.Tensor,
    weights_BQ: torch.Tensor,
    *,
    fused: bool = True,
    soft_ids_BQm: torch.Tensor | None = None,
    soft_probs_BQm: torch.Tensor | None = None,
) -> LossOutput:
    B, Q, H = hidden_BQH.shape
    args: tuple[torch.Tensor, ...] = (
        hidden_BQH.reshape(-1, H),
        lm_head_VH,
        labels_BQ.reshape(-1),
        weights_BQ.reshape(-1),
    )
    if soft_ids_BQm is not None:
        assert soft_probs_BQm is not None  # given with the ids
        m = soft_ids_BQm.shape[-1]
        args += (soft_ids_BQm.reshape(-1, m), soft_probs_BQm.reshape(-1, m))
    if fused:
        from dflash_ray.kernels.fused_ce import fused_linear_weighted_ce

        loss, correct = fused_linear_weighted_ce(*args)
    else:
        loss, correct = naive_loss(*args)
    return LossOutput(loss, correct.view(B, Q), weights_BQ.sum())


def acceptance_lengths(
    correct_BQ: torch.Tensor, weights_BQ: torch.Tensor, keep_BA: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Simulated acceptance length of every kept block, [num_kept] float."""
    B, A = keep_BA.shape
    hit = (correct_BQ & (weights_BQ > 0)).view(B, A, block_size)[:, :, 1:]
    run = hit.long().cumprod(-1).sum(-1) + 1
    return run[keep_BA].float()


def per_position_accuracy(correct_BQ: torch.Tensor, weights_BQ: torch.Tensor, block_size: int) -> torch.Tensor:
    """Top-1 accuracy at each block position k over positions with a label, [block_size]."""
    valid = (weights_BQ > 0).view(-1, block_size)
    hits = (correct_BQ.view(-1, block_size) & valid).sum(0).float()
    return hits / valid.sum(0).clamp_min(1)
