"""The whole run's settings (`RunConfig`, one section a stage or role), checked whenever one is built,
before anything runs: each field's range, each section's own rules, then the rules across sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash_ray.errors import DFlashError
from dflash_ray.settings.cluster import RayConfig
from dflash_ray.settings.data import PromptsConfig, SelfPromptConfig, TokenizeConfig, ValidateConfig
from dflash_ray.settings.drafters import expand_drafters
from dflash_ray.settings.fields import CEILING
from dflash_ray.settings.evaluation import EvaluateConfig, OneSampleConfig
from dflash_ray.settings.generation import GenerateConfig
from dflash_ray.settings.pipeline import ChaosConfig, PipelineConfig
from dflash_ray.settings.plan import PlanConfig
from dflash_ray.settings.pretrain import PretrainConfig
from dflash_ray.settings.training import TrainConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    # the kept-aside prompts' choice (stages/prompts.py) and plan's sampled lengths; each stage has its own
    seed: int = 0
    ray: RayConfig = field(default_factory=RayConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    selfprompt: SelfPromptConfig = field(default_factory=SelfPromptConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    onesample: OneSampleConfig = field(default_factory=OneSampleConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)

    def __post_init__(self):
        check(self)  # also when a command line flag replaces a field (`dataclasses.replace`)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_section(section: Any, prefix: str) -> None:
    """Every field's range (its `at_least`, `above` or `within`), through the nested sections, then
    the section's own rules across its fields (its `check`)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if "range" in f.metadata and value is not None:
            ok, allowed = f.metadata["range"]
            if not ok(value):
                if isinstance(value, (int, float)) and abs(value) > CEILING:
                    allowed += f" (no setting takes more than {CEILING:g})"
                raise DFlashError(f"{value!r} is out of range; allowed: {allowed}", field=f"{prefix}{f.name}")
        elif f.name == "tokenizer" and isinstance(value, str) and not value.strip():
            raise DFlashError("is empty: give a short name, a path or a Hub id", field=f"{prefix}{f.name}")
        elif f.name == "seed" and isinstance(value, int) and not 0 <= value < 2**32:
            # numpy's generators, the narrowest of those seeded, take no more: refused here, not by each actor
            raise DFlashError(f"{value} is out of range; allowed: in [0, {2**32 - 1}]", field=f"{prefix}{f.name}")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_section(value, f"{prefix}{f.name}.")
    rules = getattr(type(section), "check", None)  # a section's own rules (the whole config's: `check`)
    if rules is not None:
        rules(section)


def check(cfg: RunConfig) -> None:
    """Refuse values out of range and settings that contradict each other, naming the field: each
    field's range and each section's own rules (its `check`), then the rules across sections."""
    check_section(cfg, "")
    if cfg.train.drafters:
        expand_drafters(cfg)  # each drafter's values in range, as a run config of its own
    if cfg.train.block_size > cfg.tokenize.max_seq_len:
        raise DFlashError(
            f"{cfg.train.block_size} is longer than the longest sample training keeps (tokenize.max_seq_len="
            f"{cfg.tokenize.max_seq_len}): no block would fit; allowed: <= tokenize.max_seq_len",
            field="train.block_size",
        )
    if cfg.pipeline.responses and cfg.selfprompt.count > 0:
        raise DFlashError(
            "self-written prompts have no answers to train on without generation; allowed: 0 with pipeline.responses",
            field="selfprompt.count",
        )


def check_lengths(cfg: RunConfig) -> str | None:
    """Generation's lengths against what training keeps, before an engine starts (the tokens past
    `tokenize.max_seq_len` are paid for at generation and cut at tokenization).

    Refused: an answer alone may be longer than training keeps (`generate.max_tokens` above
    `tokenize.max_seq_len`): every long answer wastes its tail. Warned (returned): a long prompt plus
    a long answer may be (`generate.max_model_len`, or the prompt budget plus `generate.max_tokens`).
    """
    g, keep = cfg.generate, cfg.tokenize.max_seq_len
    if g.max_tokens > keep:
        raise DFlashError(
            f"{g.max_tokens} generated tokens per answer, above tokenize.max_seq_len={keep} "
            "that training keeps: every longer answer's tail would be generated and thrown away; "
            f"allowed: <= {keep}, or raise tokenize.max_seq_len",
            field="generate.max_tokens",
        )
    budget = cfg.prompts.max_prompt_tokens or g.max_model_len
    longest = min(g.max_model_len, budget + g.max_tokens)
    if longest > keep:
        return (
            f"generate.max_model_len={g.max_model_len} with "
            f"prompts.max_prompt_tokens={cfg.prompts.max_prompt_tokens}"
            f" and generate.max_tokens={g.max_tokens} lets a conversation reach {longest} tokens, above "
            f"tokenize.max_seq_len={keep}: the tail of a long prompt's answer is generated and then cut "
            f"(raise tokenize.max_seq_len to {longest}, or lower generate.max_model_len to {keep})"
        )
    return None
