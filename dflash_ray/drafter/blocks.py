"""Training blocks: anchor sampling, block inputs and labels, and the attention masks.

Shapes: B sequences, S context positions, A anchor slots, K = block size, Q = A*K queries.
An anchor is a position a with loss_mask[a] = loss_mask[a+1] = 1. Its block is `[x_a, MASK x K-1]`
at positions a..a+K-1; block position k predicts x[a+k] (labels are NOT shifted) and k = 0 is
excluded. A query of block j sees context positions strictly before a_j, its own block, and no
other block: bidirectional within the block for full-attention layers, causal for sliding ones
(which also see only the last `sliding_window` positions, of the context and the block alike).

Shapes reaching a compiled attention are bounded, not constant: anchor slots are fixed in number
(`num_anchors`), with a keep mask, so the query count never changes, and training pads the context to
a multiple of `train.length_bucket` (`bucket_length`), so the key count takes one value per bucket. A
slot that is not kept attends to its own block only and carries zero loss weight. Padded context
positions carry loss_mask 0, so they are never anchors, labels or visible context (every anchor lies
before them): the loss is that of the unpadded batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class Blocks:
    anchors: torch.Tensor  # [B, A] long, positions (0 in unused slots)
    keep: torch.Tensor  # [B, A] bool
    token_ids: torch.Tensor  # [B, Q] long: x_a then mask tokens
    positions: torch.Tensor  # [B, Q] long: a + k
    labels: torch.Tensor  # [B, Q] long: x[a + k] (DFlash; see `make_blocks`), 0 where invalid
    weights: torch.Tensor  # [B, Q] float: decay * loss_mask[label] * [k > 0] * [label < S] * keep
    block_size: int
    soft_ids: torch.Tensor | None = None  # [B, Q, m] with `teacher`: the label, then the target's top-k
    soft_probs: torch.Tensor | None = None  # [B, Q, m]: the mix of the two (rows sum to 1)

    @property
    def num_anchors(self) -> int:
        return self.anchors.shape[1]


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    seeds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` anchors per sequence, uniform without replacement, sorted. `seeds`: one
    per row (`schedule.anchor_seed`), each row drawn from a generator of its own seed, so a row's
    anchors depend on its sample alone, not on its batch-mates or on the draws made before it (a
    run that lost streams draws what a calm one does); None: every row from `generator`, in turn."""
    mask = loss_mask.bool()
    valid = torch.zeros_like(mask)
    valid[:, :-1] = mask[:, :-1] & mask[:, 1:]
    B = mask.shape[0]
    anchors = torch.zeros(B, num_anchors, dtype=torch.long)
    keep = torch.zeros(B, num_anchors, dtype=torch.bool)
    for b in range(B):
        candidates = valid[b].nonzero().flatten().cpu()
        if candidates.numel() == 0:
            continue
        drawing = generator if seeds is None else torch.Generator().manual_seed(seeds[b])
        pick = torch.randperm(candidates.numel(), generator=drawing)[:num_anchors]
        chosen = candidates[pick].sort().values
        anchors[b, : chosen.numel()] = chosen
        keep[b, : chosen.numel()] = True
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def position_weights(block_size: int, first_prediction: int, gamma: float) -> torch.Tensor:
    """The loss weight of each block position [K], `train.loss_decay` being gamma: the i-th prediction
    of a block (i = 0 predicts the token after the anchor) weighs exp(-i/gamma), so block position k
    weighs exp(-(k - first_prediction)/gamma), and the positions before the first prediction 0."""
    i = torch.arange(block_size, dtype=torch.float32) - first_prediction
    return torch.where(i >= 0, torch.exp(-i / gamma), torch.zeros(()))


def soft_targets(
    labels_BAK: torch.Tensor,
    teacher_ids_BSk: torch.Tensor,
    teacher_probs_BSk: torch.Tensor,
    label_pos_BAK: torch.Tensor,
    weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What each block position learns: (1 - weight) on its label and `weight` on the target's own
    next-token distribution there (its top-k, renormalized), which is the target's distribution at
    the position before the label's. Returns ids and probabilities [B, A, K, 1 + k]."""
    B, A, K = labels_BAK.shape
    before = (label_pos_BAK - 1).clamp(min=0).view(B, -1)
    k = teacher_ids_BSk.shape[-1]
    ids = torch.gather(teacher_ids_BSk, 1, before[..., None].expand(-1, -1, k)).view(B, A, K, k)
    probs = torch.gather(teacher_probs_BSk.float(), 1, before[..., None].expand(-1, -1, k)).view(B, A, K, k)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-12) * weight
    hard = torch.full((B, A, K, 1), 1.0 - weight, device=probs.device)
    return torch.cat([labels_BAK[..., None], ids], -1), torch.cat([hard, probs], -1)


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    *,
    mask_token_id: int,
    block_size: int,
    gamma: float | None = None,
    teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
    distill: float = 0.0,
    first_prediction: int = 1,
) -> Blocks:
    """Block position k predicts x[a + k + 1 - first_prediction] (DFlash: x[a+k]; the anchor's own
    next token for a family whose first prediction is k = 0), weighted by `position_weights`; gamma
    None: 7 for block 16, scaled with the block (DFlash's)."""
    B, S = input_ids.shape
    A, K = anchors.shape[1], block_size
    k = torch.arange(K, device=input_ids.device)
    pos = anchors[:, :, None] + k  # [B, A, K]
    label_pos = pos + (1 - first_prediction)
    inside = label_pos < S
    safe = label_pos.clamp(max=S - 1)
    labels = torch.gather(input_ids, 1, safe.view(B, -1)).view(B, A, K)
    label_mask = torch.gather(loss_mask.float(), 1, safe.view(B, -1)).view(B, A, K)
    decay = position_weights(K, first_prediction, gamma if gamma is not None else 7.0 * K / 16)
    weights = decay.to(input_ids.device) * label_mask * inside * keep[:, :, None]
    tokens = torch.full((B, A, K), mask_token_id, dtype=torch.long, device=input_ids.device)
    tokens[:, :, 0] = torch.gather(input_ids, 1, anchors)
    labels = torch.where(inside, labels, 0)
    soft_ids = soft_probs = None
    if teacher is not None and distill > 0:
        soft_ids, soft_probs = soft_targets(labels, *teacher, safe, distill)
        soft_ids, soft_probs = soft_ids.view(B, A * K, -1), soft_probs.view(B, A * K, -1)
    return Blocks(
        anchors=anchors,
        keep=keep,
        token_ids=tokens.view(B, -1),
        positions=pos.view(B, -1),
        labels=labels.view(B, -1),
        weights=weights.view(B, -1).float(),
        block_size=K,
        soft_ids=soft_ids,
        soft_probs=soft_probs,
    )


def bucket_length(seq_len: int, bucket: int) -> int:
    """The context length a batch of `seq_len` positions is padded to: the next multiple of `bucket`."""
    return -(-seq_len // bucket) * bucket


def _window_and_lookahead(layer_type: str, seq_len: int, block_size: int, sliding_window: int) -> tuple[int, int]:
    """A layer type as two numbers: how far back a query sees (context and block alike) and how far
    ahead inside its block (0: causal; block_size - 1: bidirectional)."""
    if layer_type == SLIDING:
        return sliding_window, 0
    return seq_len + block_size, block_size - 1  # farther than any key


def _visible(q_idx, kv_idx, anchors_b, seq_len: int, block_size: int, window, lookahead):
    """The mask rule, written once for the dense mask and flex attention's mask_mod alike. `window`
    and `lookahead` are numbers (not a layer-type string) so that flex attention, given them as
    tensors, compiles one graph for every layer type of a shape."""
    j = q_idx // block_size
    k = q_idx % block_size
    a = anchors_b[j]
    is_ctx = kv_idx < seq_len
    kv_block = (kv_idx - seq_len) // block_size
    kv_k = (kv_idx - seq_len) % block_size
    ctx_ok = (kv_idx < a) & (a + k - kv_idx < window)
    block_ok = (kv_block == j) & (kv_k - k <= lookahead) & (k - kv_k < window)
    return (is_ctx & ctx_ok) | (~is_ctx & block_ok)


def dense_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, layer_type: str = FULL, sliding_window: int = 2048
) -> torch.Tensor:
    """[B, 1, Q, S + Q] bool (True = attend), for SDPA."""
    B, A = anchors.shape
    Q = A * block_size
    q_idx = torch.arange(Q, device=anchors.device)[:, None]
    kv_idx = torch.arange(seq_len + Q, device=anchors.device)[None, :]
    rule = _window_and_lookahead(layer_type, seq_len, block_size, sliding_window)
    masks = [_visible(q_idx, kv_idx, anchors[b], seq_len, block_size, *rule) for b in range(B)]
    return torch.stack(masks)[:, None]


def flex_block_mask(
    anchors: torch.Tensor, seq_len: int, block_size: int, layer_type: str = FULL, sliding_window: int = 2048
):
    """The same rule as a flex_attention BlockMask (never materializes the dense mask on GPU). Built
    by a compiled `create_block_mask` on the GPU (one graph per shape, as for the attention); eagerly
    on the CPU, where inductor fails to compile it (torch 2.13)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, A = anchors.shape
    Q = A * block_size
    window, lookahead = (
        torch.tensor(x, device=anchors.device)
        for x in _window_and_lookahead(layer_type, seq_len, block_size, sliding_window)
    )

    def mask_mod(b, h, q_idx, kv_idx):
        return _visible(q_idx, kv_idx, anchors[b], seq_len, block_size, window, lookahead)

    create = compiled_create_block_mask() if anchors.is_cuda else create_block_mask
    return create(mask_mod, B, None, Q, seq_len + Q, device=str(anchors.device))


@functools.cache
def compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_ray.drafter.model import compile_static

    return compile_static(create_block_mask)
