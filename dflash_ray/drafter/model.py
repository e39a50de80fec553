"""The DFlash drafter: Qwen3-style decoder layers with the target's context injected as K/V.

Shapes: B batch, S context positions, Q block queries, H hidden, N captured target layers,
h query heads, g key/value heads, d head dim.

Context features (the outputs of the captured target layers, concatenated) go through
`fc` → `hidden_norm`. In every layer, keys and values come from `[context ; block]` with the same
k_proj/v_proj; queries come from the block only. RoPE uses absolute positions: context 0..S-1,
block a..a+K-1. The drafter owns no embedding and no LM head: the target's are used frozen.
Parameter names match the `DFlashDraftModel` checkpoint format that vLLM and SGLang load.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash_ray.drafter.config import DrafterConfig


def head_logits(hidden_NH: torch.Tensor, head_VH: torch.Tensor) -> torch.Tensor:
    """Logits [N, V] of a handful of rows (a decoding step's block) through the frozen head, written
    as head @ hidden^T: CPU BLAS runs a few rows against a 49k-row head about four times faster
    that way round (`bench.demo_step`); from a few dozen rows on the two are alike."""
    return (head_VH @ hidden_NH.to(head_VH.dtype).t()).t()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin [B, L, d] for absolute positions (neox layout: halves rotated together)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_BhLd: torch.Tensor, cos_BLd: torch.Tensor, sin_BLd: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BLd[:, None], sin_BLd[:, None]
    return x_BhLd * cos + _rotate_half(x_BhLd) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_type = cfg, cfg.layer_types[layer_idx]
        h, g, d, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(H, h * d, bias=False)
        self.k_proj = nn.Linear(H, g * d, bias=False)
        self.v_proj = nn.Linear(H, g * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x_BQH: torch.Tensor, ctx_BSH: torch.Tensor, rope_q, rope_kv, mask: Any) -> torch.Tensor:
        cfg = self.cfg
        B, Q, _ = x_BQH.shape
        kv_in = torch.cat([ctx_BSH, x_BQH], dim=1)
        q = self.q_norm(self.q_proj(x_BQH).view(B, Q, cfg.num_heads, cfg.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(B, kv_in.shape[1], cfg.num_kv_heads, cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(B, kv_in.shape[1], cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_kv)
        if isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:  # a flex_attention BlockMask; it wants one dtype where autocast left the normed q, k in fp32
            out = flex_attention(q.to(v.dtype), k.to(v.dtype), v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, -1))


# graphs one compiled function may hold: a run meets one per padded length, mask kind and grad mode
# (`train.shape.compiled_shapes`: 24 x 2 x 2 = 96 for the Qwen3.6-27B preset), each compiled once
MAX_SHAPES = 128


def compile_static(fn):
    """`fn` compiled for static shapes: one graph per distinct input shape, which callers keep few
    (training pads the context to `train.length_bucket` multiples and keeps the anchor count fixed).
    Past MAX_SHAPES shapes it raises instead of falling back to eager, where flex attention
    materializes the whole score matrix (an out-of-memory error at scale)."""
    compiled = torch.compile(fn, dynamic=False)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=MAX_SHAPES, fail_on_recompile_limit_hit=True):
            return compiled(*args, **kwargs)

    return call


@functools.cache
def compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention as eager

    return compile_static(eager)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """Flex attention, compiled on CUDA (uncompiled it materializes the scores and is slow); the CPU
    runs it eagerly, since compiled flex attention has no backward there (forward only: torch 2.13)."""
    if not q.is_cuda:
        from torch.nn.attention.flex_attention import flex_attention as eager

        return eager(q, k, v, block_mask=block_mask, enable_gqa=True)
    return compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=True)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    layer_cls = DecoderLayer  # a family may wrap the sublayers (DFlash2's convolutions)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def context(self, features_BSF: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features_BSF))

    def forward(
        self,
        features_BSF: torch.Tensor,
        block_embeds_BQH: torch.Tensor,
        block_positions_BQ: torch.Tensor,
        masks: dict[str, Any],
        ctx_positions_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states of the block queries [B, Q, H]; `masks` maps each layer type
        to a dense SDPA mask or a flex BlockMask."""
        cfg = self.cfg
        ctx = self.context(features_BSF)
        B, S, _ = ctx.shape
        if ctx_positions_BS is None:
            ctx_positions_BS = torch.arange(S, device=ctx.device).expand(B, S)
        dtype = block_embeds_BQH.dtype
        rope_q = rope_cos_sin(block_positions_BQ, cfg.head_dim, cfg.rope_theta, dtype)
        kv_positions = torch.cat([ctx_positions_BS, block_positions_BQ], 1)
        rope_kv = rope_cos_sin(kv_positions, cfg.head_dim, cfg.rope_theta, dtype)
        x = block_embeds_BQH
        for layer in cast("list[DecoderLayer]", self.layers):
            x = layer(x, ctx, rope_q, rope_kv, masks[layer.self_attn.layer_type])
        return self.norm(x)
