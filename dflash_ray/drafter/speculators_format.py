"""Drafters saved by vLLM's `speculators` trainer (github.com/vllm-project/speculators, its DFlash
format), read as this project's own: `export`, `evaluate` and `train.init_from` take their folder.

What such a folder holds (speculators' `models/dflash/config.py`, `models/dflash/core.py`, `model.py`,
`config.py`, `train/checkpointer.py`, `convert/dflash/converter.py`):
- `config.json`, written by transformers' `save_pretrained`: `speculators_model_type: "dflash"` (the key
  no config.json of ours has: how their folder is told from ours, since `architectures` is
  `["DFlashDraftModel"]` in both), `speculators_version`, `speculators_config` (algorithm, proposal
  methods, and the `verifier`: the target's `name_or_path` and `architectures`), the draft layers as a
  Qwen3 config under `transformer_layer_config` (sizes, heads, `head_dim`, `layer_types`,
  `sliding_window`, the target's `vocab_size`, and RoPE as `rope_parameters` from transformers 5 on,
  `rope_theta` before), and `draft_vocab_size`, `block_size`, `target_hidden_size`,
  `aux_hidden_state_layer_ids`, `mask_token_id`, `sliding_window_non_causal`, `sample_from_anchor`.
- `model.safetensors`: the draft body under this project's names (both follow z-lab's
  `DFlashDraftModel`, whose weights speculators' converter copies as they are), beside frozen copies
  of the target's `embed_tokens.weight` and `lm_head.weight` (`verifier_*` are left out on save), which
  this format does not hold: the target's own are used.

Layer ids: speculators counts the target's hidden states the way HF's `output_hidden_states` does,
the embedding output as 0 and decoder layer i's output as i + 1 (its converter from z-lab's format
adds one, and vLLM's `update_dflash` subtracts one to fill `dflash_config.target_layer_ids`,
vllm#40727). Ours is the decoder layer whose output is captured, so ours = theirs - 1, and their 0,
the embedding, is no layer of ours. The target's layer count is not in their config.json: it comes
from the caller (a run knows its target), a `num_target_layers` added to the file, or the verifier's
config.json. Only the DFlash drafter is read; a setting our DFlash drafter does not compute (a reduced
draft vocabulary, the anchor as a prediction, non-causal sliding layers, another RoPE) is refused by
name, as is a weight with no counterpart here. No torch at import, no Ray.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from dflash_ray.drafter import config_checks as checks
from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    import torch

KEY = "speculators_model_type"
TARGET_LAYERS = "num_target_layers"  # the one key of ours a user may add to their config.json
_LAYERS = "transformer_layer_config"
_VERIFIER = "speculators_config.verifier.name_or_path"

# their weight name (a full match) -> ours
RENAMES = (
    (r"fc\.weight", r"fc.weight"),
    (r"hidden_norm\.weight", r"hidden_norm.weight"),
    (r"norm\.weight", r"norm.weight"),
    (r"layers\.(\d+)\.self_attn\.([qkvo]_proj|[qk]_norm)\.weight", r"layers.\1.self_attn.\2.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", r"layers.\1.mlp.\2_proj.weight"),
    (r"layers\.(\d+)\.(input|post_attention)_layernorm\.weight", r"layers.\1.\2_layernorm.weight"),
)
# their tensors that are the target's own, frozen: at serving time the target's are used
TARGET_COPIES = frozenset({"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"})


def is_speculators(data: Any) -> bool:
    """Whether a parsed config.json is one speculators wrote."""
    return isinstance(data, dict) and KEY in data


def hf_config(data: dict[str, Any], file: str, num_target_layers: int | None = None) -> dict[str, Any]:
    """Their config.json as ours (`export.from_hf_config` reads it), every field read checked first:
    a missing, mistyped or unservable one is a DFlashError naming `file` and their field.
    `num_target_layers`: the target's layer count where the caller knows it."""
    try:
        return _hf_config(checks.Fields(data), num_target_layers)
    except DFlashError as e:
        if e.file is not None:
            raise
        raise DFlashError(e.message, file=file, field=e.field) from None


def _hf_config(top: checks.Fields, num_target_layers: int | None) -> dict[str, Any]:
    kind = top.get(KEY, "'dflash'")
    if kind != "dflash":
        raise top.bad(KEY, "'dflash' (the only speculators drafter this project reads)", kind)
    layers = top.section(_LAYERS)
    block_size = top.whole("block_size", 2, checks.MAX_BLOCK)
    target_layers = _target_layers(top, num_target_layers)
    shared = checks.shared_fields(
        checks.Fields(
            {**layers.data, TARGET_LAYERS: target_layers, "block_size": block_size, "rope_theta": _rope_theta(layers)},
            _LAYERS,
        )
    )
    _check_computes_alike(top, layers, shared)
    vocab = shared["vocab_size"]
    mask_token_id = top.whole("mask_token_id", 0, vocab - 1, note=f" (a row of the vocab_size {vocab} embedding)")
    theirs = top.wholes(
        "aux_hidden_state_layer_ids",
        1,
        target_layers,
        checks.MAX_FEATURES,
        f" (speculators counts the embedding output as 0 and decoder layer i's output as i + 1, of the "
        f"target's {target_layers} layers; the embedding output is no layer this project captures)",
    )
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **{k: v for k, v in shared.items() if k not in ("num_layers", "num_heads", "num_kv_heads")},
        "num_hidden_layers": shared["num_layers"],
        "num_attention_heads": shared["num_heads"],
        "num_key_value_heads": shared["num_kv_heads"],
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": [i - 1 for i in theirs]},
    }


def _rope_theta(layers: checks.Fields) -> float:
    """The base of the plain RoPE our drafter computes: `rope_parameters` (transformers 5) or
    `rope_theta` and an empty `rope_scaling` (transformers 4)."""
    if layers.data.get("rope_parameters") is not None:
        rope = layers.section("rope_parameters")
        other = sorted(set(rope.data) - {"rope_type", "rope_theta"})
        if other:  # mrope sections, partial rotary factors, scaling factors
            raise DFlashError(
                "a RoPE this project's drafter does not compute (plain RoPE only)", field=rope.name(other[0])
            )
        rope.choice("rope_type", ("default",), "default")
        return rope.real("rope_theta", 0.0, 1e15)
    if layers.data.get("rope_scaling") is not None:
        raise layers.bad(
            "rope_scaling", "null (plain RoPE is what this project's drafter computes)", layers.data["rope_scaling"]
        )
    return layers.real("rope_theta", 0.0, 1e15)


def _check_computes_alike(top: checks.Fields, layers: checks.Fields, shared: dict[str, Any]) -> None:
    """Refuse what their drafter computes and ours does not, naming the setting."""
    layers.choice("hidden_act", ("silu",), "silu")
    if layers.flag("attention_bias", False):
        raise layers.bad("attention_bias", "false (this project's drafter has no q/k/v/o biases)", True)
    draft_vocab = top.whole("draft_vocab_size", 1, checks.MAX_VOCAB)
    if draft_vocab != shared["vocab_size"]:
        raise DFlashError(
            f"{draft_vocab}: a reduced draft vocabulary (its d2t/t2d maps) against the target's "
            f"{shared['vocab_size']}; this project's drafter predicts over the target's whole vocabulary",
            field="draft_vocab_size",
        )
    width = top.get("target_hidden_size", "null or the hidden_size", None)
    if width is not None and width != shared["hidden_size"]:
        raise top.bad("target_hidden_size", f"null or the hidden_size {shared['hidden_size']}", width)
    if top.flag("sample_from_anchor", False):  # speculators' default; older versions lack the key
        raise top.bad("sample_from_anchor", "false (a DFlash block's anchor is no prediction)", True)
    if top.flag("sliding_window_non_causal", False) and "sliding_attention" in shared["layer_types"]:
        raise top.bad(
            "sliding_window_non_causal", "false where layers slide (this project's sliding layers are causal)", True
        )


def _target_layers(top: checks.Fields, given: int | None) -> int:
    """The target's layer count: the caller's, a `num_target_layers` added to the file, else the
    verifier's config.json (a local folder, `s3://`, or a Hub id: its small files only)."""
    if given is not None:
        return given
    if TARGET_LAYERS in top.data:
        return top.whole(TARGET_LAYERS, 1, checks.MAX_LAYERS)
    name = top.section("speculators_config").section("verifier").get("name_or_path", "the target's Hub id or folder")
    if not isinstance(name, str) or not name.strip():
        raise _unreachable(f"it names none: {name!r}")
    config = _verifier_config(name)
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers") if isinstance(text, dict) else None
    if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= checks.MAX_LAYERS:
        raise DFlashError(f"the config.json of {name} gives no num_hidden_layers ({layers!r})", field=_VERIFIER)
    return layers


def _verifier_config(name: str) -> dict[str, Any]:
    from pathlib import Path

    from dflash_ray import registry, storage

    try:
        if storage.is_s3(name):
            raw = storage.read_bytes(storage.join(name, "config.json"))
        else:
            raw = (Path(registry.config_dir(name)) / "config.json").read_bytes()
        return checks.parse(raw, name)
    except (DFlashError, OSError) as e:
        raise _unreachable(str(e)) from None


def _unreachable(why: str) -> DFlashError:
    return DFlashError(
        f"the target's layer count is not in a speculators config.json, and its verifier's config.json "
        f'cannot be read ({why}); add "{TARGET_LAYERS}": <the target\'s num_hidden_layers> to this config.json',
        field=_VERIFIER,
    )


def our_weights(state: dict[str, torch.Tensor], file: str) -> dict[str, torch.Tensor]:
    """Their tensors under our names (`RENAMES`), the target's own copies left out; one with no
    counterpart here is a DFlashError naming it."""
    ours = {}
    for name, tensor in state.items():
        if name in TARGET_COPIES:
            continue
        for pattern, replacement in RENAMES:
            if m := re.fullmatch(pattern, name):
                ours[m.expand(replacement)] = tensor
                break
        else:
            raise DFlashError(
                "a speculators weight with no counterpart in this project's DFlash drafter", file=file, field=name
            )
    return ours
