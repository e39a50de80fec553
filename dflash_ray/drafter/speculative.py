"""Greedy speculative decoding with a DFlash drafter against a Hugging Face target (no Ray).

Each step the drafter proposes a block `[last, d_1..d_{K-1}]` in one non-causal pass, the target
verifies the whole block in one forward, and the longest prefix of drafts that equals the target's
own greedy choices is committed, plus the target's next token (the bonus). The drafter's context
grows by the target's hidden states of the committed tokens. The output equals the target's own
greedy output token for token; acceptance length per step = accepted drafts + 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dflash_ray.drafter.model import DFlashDrafter
from dflash_ray.drafter.step import attention_masks
from dflash_ray.target.capture import capture


@dataclass
class Generation:
    token_ids: list[int]  # generated tokens (prompt excluded)
    acceptance: list[int] = field(default_factory=list)  # tokens committed per verify step
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(len(self.acceptance), 1)


@torch.no_grad()
def target_greedy(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> Generation:
    """The target alone, one token per forward, with its KV cache: the reference."""
    from transformers import DynamicCache

    start = time.perf_counter()
    device = target.device
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=device)
    out_tokens: list[int] = []
    while len(out_tokens) < max_new_tokens:
        logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        token = int(logits.argmax())
        out_tokens.append(token)
        if token in eos_ids:
            break
        ids = torch.tensor([[token]], device=device)
    return Generation(out_tokens, seconds=time.perf_counter() - start)


@torch.no_grad()
def speculative_greedy(target, drafter: DFlashDrafter, embed_VH: torch.Tensor, head_VH: torch.Tensor,
                       prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> Generation:
    from transformers import DynamicCache

    cfg = drafter.cfg
    K, layer_ids = cfg.block_size, cfg.target_layer_ids
    start = time.perf_counter()
    device = target.device  # the drafter, embedding and head live beside the target
    cache = DynamicCache()
    with capture(target, layer_ids, stop_after_last=False) as captured:
        logits = target(input_ids=torch.tensor([prompt_ids], device=device), past_key_values=cache,
                        use_cache=True).logits
        context = torch.cat([captured[i] for i in layer_ids], -1)  # [1, n, F]
    out_tokens = [int(logits[0, -1].argmax())]
    acceptance: list[int] = []
    dtype = next(drafter.parameters()).dtype
    while len(out_tokens) < max_new_tokens and out_tokens[-1] not in eos_ids:
        n = context.shape[1]  # committed tokens the target has processed; the last one has not
        block_ids = torch.full((1, K), cfg.mask_token_id, device=device)
        block_ids[0, 0] = out_tokens[-1]
        positions = torch.arange(n, n + K, device=device)[None]
        hidden = drafter(context.to(dtype), F.embedding(block_ids, embed_VH).to(dtype), positions,
                         attention_masks(drafter, torch.tensor([[n]], device=device), n, "sdpa"))  # one block after the context
        drafts = (hidden[0, 1:].to(head_VH.dtype) @ head_VH.t()).argmax(-1)
        block_ids[0, 1:] = drafts
        with capture(target, layer_ids, stop_after_last=False) as captured:
            logits = target(input_ids=block_ids, past_key_values=cache, use_cache=True,
                            position_ids=positions).logits[0]
            feats = torch.cat([captured[i] for i in layer_ids], -1)
        greedy = logits.argmax(-1)  # greedy[i]: the target's choice after block token i
        accepted = int((drafts == greedy[:-1]).long().cumprod(0).sum())
        new = drafts[:accepted].tolist() + [int(greedy[accepted])]
        room = max_new_tokens - len(out_tokens)
        new = new[:room]
        for i, token in enumerate(new):  # stop at the first end-of-sequence token
            if token in eos_ids:
                new = new[: i + 1]
                break
        out_tokens += new
        acceptance.append(len(new))
        # the target processed block tokens 0..accepted; keep their cache and features only
        cache.crop(n + accepted + 1)
        context = torch.cat([context, feats[:, : accepted + 1]], dim=1)
    return Generation(out_tokens, acceptance, time.perf_counter() - start)
