"""Tiny random targets built from configs, for tests and benchmarks (nothing is downloaded).

The vocabularies are the real ones (Qwen3: 151,936; Qwen3.5: 248,320), so the packaged tokenizers
and the mask-token checks work against them; the rest is as small as the architectures allow.
"""

from __future__ import annotations

from pathlib import Path


def _saved(model_class, config, out_dir: str | Path, device: str, dtype: str) -> str:
    """A random `model_class` of `config`, built on `device` in `dtype` and saved as safetensors."""
    import torch

    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = model_class(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(out_dir, safe_serialization=True)
    return str(out_dir)


def tiny_qwen3(
    out_dir: str | Path,
    *,
    num_layers: int = 6,
    hidden_size: int = 64,
    vocab_size: int = 151936,
    seed: int = 0,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> str:
    """A random Qwen3 causal LM saved as safetensors; returns its folder. The defaults are tiny; the
    GPU check builds one at a real target's width (on the GPU, in bf16, which is much faster)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    return _saved(Qwen3ForCausalLM, config, out_dir, device, dtype)


def tiny_qwen35(
    out_dir: str | Path,
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    seed: int = 0,
    vocab_size: int = 248320,
    intermediate_size: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    linear_key_heads: int = 2,
    linear_value_heads: int = 4,
    linear_head_dim: int = 16,
    device: str = "cpu",
    dtype: str = "float32",
) -> str:
    """A random hybrid Qwen3.5 LM (Gated-DeltaNet + full attention every 4th layer). The defaults are
    tiny; the GPU check builds a few layers at Qwen3.6-27B's width (on the GPU, in bf16)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    layer_types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]
    config = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_num_key_heads=linear_key_heads,
        linear_num_value_heads=linear_value_heads,
        layer_types=layer_types,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return _saved(Qwen3_5ForCausalLM, config, out_dir, device, dtype)
