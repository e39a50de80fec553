"""The DFlash family: the drafter of `model.py`, the loss of `forward.py`, one parallel draft per block.

Block `[x_a, MASK x K-1]` at positions a..a+K-1; position k predicts x[a+k] and k = 0 (the anchor)
is no prediction, so a block drafts K - 1 tokens, all chosen at once from the block's logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_ray.drafter import families
from dflash_ray.drafter.config import DrafterConfig
from dflash_ray.drafter.model import DFlashDrafter, head_logits
from dflash_ray.drafter.speculative import Sampling, warp
from dflash_ray.drafter.forward import attention_masks, forward_loss


class DFlash:
    name = "dflash"
    architecture = "DFlashDraftModel"
    vllm_method = "dflash"
    first_prediction = 1
    vllm_on_cpu = True
    hf_keys = frozenset({"dflash_config"})
    Settings = families.Settings  # none of its own

    def build(self, cfg: DrafterConfig) -> DFlashDrafter:
        return DFlashDrafter(cfg)

    def forward_loss(self, drafter, *args, **kwargs):
        return forward_loss(drafter, *args, **kwargs)

    def propose(
        self,
        drafter: DFlashDrafter,
        context_1nF: torch.Tensor,
        last_token: int,
        embed_VH: torch.Tensor,
        head_VH: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = drafter.cfg
        device, n = context_1nF.device, context_1nF.shape[1]
        dtype = next(drafter.parameters()).dtype
        block_ids = torch.full((1, cfg.block_size), cfg.mask_token_id, device=device)
        block_ids[0, 0] = last_token
        positions = torch.arange(n, n + cfg.block_size, device=device)[None]
        masks = attention_masks(drafter, torch.tensor([[n]], device=device), n, "sdpa")  # one block after the context
        hidden = drafter(context_1nF.to(dtype), F.embedding(block_ids, embed_VH).to(dtype), positions, masks)
        logits = head_logits(hidden[0, 1:], head_VH)
        if sampling.greedy or sampling.greedy_drafts:
            return logits.argmax(-1), None
        q = warp(logits, sampling.temperature, sampling.top_p)
        return torch.multinomial(q, 1, generator=sampling.generator)[:, 0], q

    def hf_config(self, cfg: DrafterConfig) -> dict:
        return {
            "architectures": [self.architecture],
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
        }

    def read_hf_config(self, data: dict) -> dict:
        return {
            "mask_token_id": data["dflash_config"]["mask_token_id"],
            "target_layer_ids": list(data["dflash_config"]["target_layer_ids"]),
        }


FAMILY = DFlash()
