"""The drafter's starting weights: random, or the target's own layers.

A drafter layer has the shape of a target decoder layer, so it can start as a copy of the layers
right after the deepest captured one: `fc` starts by passing that layer's output through,
`hidden_norm` is the copied layer's input norm, the final norm is the target's. The drafter then
starts out reading the context the way the target's next layer does, instead of learning it from
nothing. Only targets whose decoder layers are the drafter's own (RMSNorm weights applied as is,
no q/k/v bias) can be copied. Its gain over the random start on SmolLM2: `bench/start.py`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dflash_ray.drafter.config import DrafterConfig
from dflash_ray.drafter.model import DFlashDrafter
from dflash_ray.target_model.capture import read_tensors

# model types whose decoder layers have the drafter's parameters and semantics
COPYABLE = ("llama", "mistral", "qwen3")
_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.(.+)$")
_NORM = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?norm\.weight$")


def source_layers(drafter: DFlashDrafter) -> list[int]:
    """The target layer each drafter layer starts from (while the target has layers left)."""
    cfg = drafter.cfg
    first = max(cfg.target_layer_ids) + 1
    return list(range(first, min(first + cfg.num_layers, cfg.num_target_layers)))


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target_dir: str | Path) -> list[int]:
    """Copy the target's layers into the drafter (see the module docstring). Drafter layers past
    the target's last keep their random start; q/k norms the target lacks stay at one. Returns
    the target layers copied."""
    cfg = drafter.cfg
    sources = source_layers(drafter)
    if not sources:
        return []
    wanted = set(sources)

    def want(key: str) -> bool:
        m = _LAYER.match(key)
        return bool(_NORM.match(key)) or (m is not None and int(m.group(1)) in wanted)

    tensors = read_tensors(target_dir, want)
    layer_tensors = {(int(m.group(1)), m.group(2)): v for k, v in tensors.items() if (m := _LAYER.match(k))}
    for layer, src in zip(drafter.layers, sources):
        for name, param in layer.named_parameters():
            if name.startswith(getattr(layer, "not_in_target", ())):  # a family's own parts keep their start
                continue
            value = layer_tensors.get((src, name))
            if value is None:
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    continue
                raise ValueError(f"target layer {src} has no '{name}' to start the drafter from")
            if value.shape != param.shape:
                raise ValueError(
                    f"target layer {src} '{name}' is {tuple(value.shape)}, the drafter's is {tuple(param.shape)}"
                )
            param.copy_(value)
    H, deepest = cfg.hidden_size, cfg.target_layer_ids.index(max(cfg.target_layer_ids))
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * H : (deepest + 1) * H] = torch.eye(H)
    drafter.hidden_norm.weight.copy_(layer_tensors[(sources[0], "input_layernorm.weight")])
    norm = next((v for k, v in tensors.items() if _NORM.match(k)), None)
    if norm is not None:
        drafter.norm.weight.copy_(norm)
    return sources


def init_mode(target_config, init: str) -> str:
    """ "target" or "random" for the `train.init` setting ("auto": the target's layers where they fit)."""
    if init == "random":
        return "random"
    model_type = getattr(getattr(target_config, "text_config", None) or target_config, "model_type", None)
    if model_type in COPYABLE:
        return "target"
    if init == "target":
        raise ValueError(
            f"init 'target' copies decoder layers of {', '.join(COPYABLE)} targets; "
            f"this target is '{model_type}' (use init 'auto' or 'random')"
        )
    return "random"


def initial_drafter(cfg: DrafterConfig, target_dir: str | Path, mode: str, seed: int) -> DFlashDrafter:
    """The drafter training starts from: the same on every rank and for the untrained baseline.
    `mode`: "target", "random", or a released drafter's folder after `warm_start.PREFIX`."""
    from dflash_ray.drafter import families, warm_start

    torch.manual_seed(seed)
    drafter = families.get(cfg.family).build(cfg)
    if mode == "target":
        init_from_target(drafter, target_dir)
    elif mode.startswith(warm_start.PREFIX):
        warm_start.load_released(drafter, cfg, mode.removeprefix(warm_start.PREFIX))
    return drafter
