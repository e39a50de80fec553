"""The one typed run config: a YAML file plus dotted `--set a.b=c` overrides.

Each stage owns a frozen dataclass, defined in `dflash_ray/settings/` beside the code that reads
it; `RunConfig` composes them. Building from a mapping rejects unknown keys (listing the valid
ones) and values of the wrong type, naming the dotted field, so a typo fails before any actor
starts. The resolved config is saved next to every output. This module gathers the names callers
import; each is one import away from its owner.
"""

from __future__ import annotations

from dflash_ray.settings.cluster import RayConfig
from dflash_ray.settings.coerce import coerce_field
from dflash_ray.settings.data import (
    GateConfig,
    PromptsConfig,
    SelfPromptConfig,
    SourceConfig,
    TokenizeConfig,
    ValidateConfig,
)
from dflash_ray.settings.drafter_shape import LAYER_TYPES, MOVED_TO_FAMILY, family_names
from dflash_ray.settings.drafters import PER_DRAFTER, check_drafters, expand_drafters, expand_train
from dflash_ray.settings.evaluation import EvaluateConfig, OneSampleConfig
from dflash_ray.settings.fields import above, at_least, operational, within
from dflash_ray.settings.generation import AutoscaleConfig, GenerateConfig
from dflash_ray.settings.loading import apply_override, config_from_dict, load_config, merge_settings, read_settings
from dflash_ray.settings.optimizer import TRACKERS
from dflash_ray.settings.pipeline import FAULT_KINDS, ChaosConfig, PipelineConfig, parse_faults
from dflash_ray.settings.plan import PLAN_GPUS, PlanConfig
from dflash_ray.settings.pretrain import PretrainConfig
from dflash_ray.settings.resilience import ClocksConfig
from dflash_ray.settings.run import RunConfig, check, check_lengths
from dflash_ray.settings.training import TrainConfig

__all__ = [
    "AutoscaleConfig",
    "ChaosConfig",
    "ClocksConfig",
    "EvaluateConfig",
    "FAULT_KINDS",
    "GateConfig",
    "GenerateConfig",
    "LAYER_TYPES",
    "MOVED_TO_FAMILY",
    "OneSampleConfig",
    "PER_DRAFTER",
    "PLAN_GPUS",
    "PipelineConfig",
    "PlanConfig",
    "PretrainConfig",
    "PromptsConfig",
    "RayConfig",
    "RunConfig",
    "SelfPromptConfig",
    "SourceConfig",
    "TRACKERS",
    "TokenizeConfig",
    "TrainConfig",
    "ValidateConfig",
    "above",
    "apply_override",
    "at_least",
    "check",
    "check_drafters",
    "check_lengths",
    "coerce_field",
    "config_from_dict",
    "expand_drafters",
    "expand_train",
    "family_names",
    "load_config",
    "merge_settings",
    "operational",
    "parse_faults",
    "read_settings",
    "within",
]
