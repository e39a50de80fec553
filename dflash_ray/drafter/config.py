"""The drafter's architecture, derived from the target's Hugging Face config.

Hidden size, vocabulary, RoPE and norm settings come from the target; the drafter's own depth,
heads and layer types are choices. `target_layer_ids` are 0-based decoder layers whose OUTPUT is
captured (HF `output_hidden_states[id + 1]`, a forward hook on `layers[id]`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, cast

BLOCK_SIZE = 16


def default_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """`round(1 + i*(L-4)/(n-1))`: for L=64, n=5 → [1, 16, 31, 46, 61]."""
    if num_ids == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_ids - 1)) for i in range(num_ids)]


@dataclass(frozen=True, kw_only=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    layer_types: list[str]  # "full_attention" | "sliding_attention"
    sliding_window: int = 2048
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    block_size: int = BLOCK_SIZE
    tie_word_embeddings: bool = False
    family: str = "dflash"  # the drafter family (`drafter/families.py`): its model, loss and decoding rule
    # the family's own `Settings`; a mapping (or None: the defaults) is read into them on construction
    settings: Any = None
    extra: dict[str, Any] = field(default_factory=dict)  # target fields kept for export

    def __post_init__(self):
        for key, low in (("block_size", 2), ("num_layers", 1), ("num_target_layers", 1), ("vocab_size", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{key} {value!r}; allowed: a whole number >= {low}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}")
        bad = [t for t in self.layer_types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise ValueError(f"layer_types: unknown {bad}; valid: full_attention, sliding_attention")
        out = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if out:
            raise ValueError(f"target_layer_ids {out} outside the target's {self.num_target_layers} layers")
        from dflash_ray.drafter import families

        families.get(self.family)  # a ValueError naming the valid ones
        object.__setattr__(self, "settings", families.settings(self.family, self.settings, "settings"))
        self.settings.check(self)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is not a row of the target's "
                f"{self.vocab_size}-entry embedding table"
            )

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def replace(self, **changes) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)


def _rope_theta(target_config) -> float:
    params = getattr(target_config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        rope_type = params.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"target RoPE type '{rope_type}' is not supported by the drafter yet")
        return float(params["rope_theta"])
    return float(getattr(target_config, "rope_theta", 10000.0))


def from_target(
    target_config,
    *,
    mask_token_id: int,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    num_target_features: int = 5,
    layer_types: list[str] | None = None,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    sliding_window: int = 2048,
    block_size: int = BLOCK_SIZE,
    special_token_ids: tuple[int, ...] = (),
    family: str = "dflash",
    settings: Any = None,
) -> DrafterConfig:
    """A drafter for `target_config` (any HF causal LM config; for multimodal ones, its text config).

    `special_token_ids` (pad, eos, bos) may not be the mask token: the drafter would learn to
    confuse "unknown yet" with "end of text". `settings`: the family's own (a mapping, or None:
    its defaults).
    """
    text = getattr(target_config, "text_config", None) or target_config
    num_target_layers = text.num_hidden_layers
    if mask_token_id in special_token_ids:
        raise ValueError(f"mask_token_id {mask_token_id} is a pad/eos/bos token of the target")
    ids = target_layer_ids or default_layer_ids(num_target_layers, min(num_target_features, num_target_layers))
    n_heads = num_heads or text.num_attention_heads
    return DrafterConfig(
        hidden_size=text.hidden_size,
        intermediate_size=intermediate_size or text.intermediate_size,
        num_layers=num_layers,
        num_heads=n_heads,
        num_kv_heads=cast(int, num_kv_heads or getattr(text, "num_key_value_heads", n_heads)),
        head_dim=head_dim or getattr(text, "head_dim", None) or text.hidden_size // n_heads,
        vocab_size=text.vocab_size,
        num_target_layers=num_target_layers,
        target_layer_ids=list(ids),
        mask_token_id=mask_token_id,
        layer_types=layer_types or ["full_attention"] * num_layers,
        block_size=block_size,
        sliding_window=sliding_window,
        rope_theta=_rope_theta(text),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 40960)),
        tie_word_embeddings=bool(getattr(target_config, "tie_word_embeddings", False)),
        family=family,
        settings=settings,
    )
