"""Whether a hybrid target's Gated-DeltaNet layers will run on their fast kernels.

transformers runs a Gated-DeltaNet layer (Qwen3.5/3.6, Qwen3-Next) through flash-linear-attention
and causal-conv1d when they import, and otherwise falls back to its torch reference path, more than
ten times slower on a GPU, with one log line. A CUDA run on that path would spend days where hours
were planned; the target actor checks at its start instead, and refuses unless the run allows it
(`train.allow_slow_target`). The CPU always runs the torch path (the kernels need CUDA). No Ray here.
"""

from __future__ import annotations

import importlib

from torch import nn

from dflash_ray.errors import DFlashError

# the distribution to install -> (module, function transformers looks up in it)
KERNELS = {
    "flash-linear-attention": ("fla", "chunk_gated_delta_rule"),
    "causal-conv1d": ("causal_conv1d", "causal_conv1d_fn"),
}


def linear_attention_layers(model: nn.Module) -> int:
    """Gated-DeltaNet layers in `model` (0 for a plain-attention target)."""
    return sum(type(m).__name__.endswith("GatedDeltaNet") for m in model.modules())


def missing_kernels() -> list[str]:
    """The distributions whose kernel transformers would not find (it then takes the torch path)."""
    missing = []
    for distribution, (module, function) in KERNELS.items():
        try:
            if getattr(importlib.import_module(module), function, None) is None:
                missing.append(distribution)
        except Exception:  # noqa: BLE001 (transformers treats any import failure as "not installed")
            missing.append(distribution)
    return missing


def check(model: nn.Module, device: str, allow_slow: bool) -> list[str]:
    """The missing kernels of a hybrid target on `device` ([] when none is missing or it runs on the
    CPU). Raises on CUDA unless `allow_slow`, naming what to install and the setting that goes on anyway."""
    if not device.startswith("cuda") or not linear_attention_layers(model):
        return []
    missing = missing_kernels()
    if missing and not allow_slow:
        raise DFlashError(
            f"the target's {linear_attention_layers(model)} Gated-DeltaNet layers would run on "
            f"transformers' torch fallback, over 10x slower on a GPU: {', '.join(missing)} does not "
            f"import on the target's node; install it (pip install {' '.join(missing)}, the `gpu` "
            "extra), or set train.allow_slow_target=true to go on anyway",
            field="train.allow_slow_target",
        )
    return missing
