"""The data stages' settings: `prompts` and its mix (stages/prompts.py, data/mix.py), `selfprompt`
(generation/selfprompt.py), `tokenize` (stages/tokenize.py, data/masking.py) and `validate`'s gate
(data/validate.py, data/mask_bounds.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_ray.errors import DFlashError
from dflash_ray.hub_uri import is_hub_dataset, parse
from dflash_ray.settings.fields import at_least, within


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    """One source of a dataset mix (`prompts.sources`). At most one of `count` and `weight`; neither:
    all of its prompts."""

    uri: str = ""  # a file, a folder, s3://, or hf://datasets/ORG/NAME[/CONFIG][@REVISION][:SPLIT]
    count: int | None = None  # prompts taken from it, after quarantine and dedup
    weight: float | None = None  # its share of prompts.mix_total, against the other weights


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptsConfig:
    # conversations of several user turns: `regenerate` (the target answers turn by turn, its answers
    # in the history), `user_turns` (all user turns as one prompt), `per_turn` (a prompt per prefix)
    multi_turn: Literal["regenerate", "user_turns", "per_turn"] = "regenerate"
    tokenizer: str = "qwen3"  # counts prompt tokens for the budget
    max_prompt_tokens: int = at_least(0, default=4096)  # 0: no budget
    shard_size: int = at_least(1, default=512)  # prompts per output shard (the generation work unit)
    # a dataset mix: sources read in order (a prompt an earlier source gave is a duplicate later);
    # a source with a count or weight is read in a seeded shuffle and stops once it has given them
    sources: list[SourceConfig] = field(default_factory=list)
    mix_total: int = at_least(0, default=0)  # prompts the weighted sources give together (> 0 when any has a weight)
    seed: int = 0  # the shuffles' seed
    # records held and shuffled at a time: a source this size or smaller is shuffled uniformly; a larger
    # one mixes within the window (shuffle it upstream if it is sorted)
    shuffle_buffer: int = at_least(1, default=50_000)

    def check(self) -> None:
        check_sources(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class SelfPromptConfig:
    """Prompts the target writes itself (`dflash-ray selfprompt`; the pipeline when count > 0).
    The engine and its resources are generate's."""

    count: int = at_least(0, default=0, most=10**7)  # candidates to sample (fewer prompts remain after the drops)
    system: str = ""  # a system message opening each conversation; "": the template's default
    temperature: float = at_least(0, default=1.0, most=100)
    top_p: float = within(0, 1, low_open=True, default=0.95)
    max_tokens: int = at_least(1, default=96, most=1 << 20)  # a message cut here is dropped
    min_chars: int = at_least(0, default=16)
    # the first `openers` candidates are sampled freely; every later one continues one of their distinct
    # openings (first `opener_tokens` tokens), each used equally (generation/selfprompt.py); 0: all free
    openers: int = at_least(0, default=256)
    opener_tokens: int = at_least(1, default=3)
    # a message whose word trigrams overlap an earlier one's by more than this (Jaccard) is a near copy
    max_similarity: float = within(0, 1, default=0.6)
    min_letter_share: float = within(0, 1, default=0.6)  # of a message's non-space characters; under it: degenerate
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizeConfig:
    tokenizer: str = "qwen3"
    # what training keeps of a sample; at least generate.max_model_len (check_lengths)
    max_seq_len: int = at_least(2, default=8192, most=1 << 21)
    overlong: Literal["drop", "truncate"] = "truncate"
    enable_thinking: bool = True  # template flag; must match how the data was generated
    batch_size: int = at_least(1, default=256)  # rows per Ray Data batch
    concurrency: int | None = at_least(1, default=None)  # tokenizer workers; None: min(CPUs, rows / 1,000)


@dataclass(frozen=True, kw_only=True, slots=True)
class GateConfig:
    max_mode_share: float = within(0, 1, default=0.20)  # one loss-mask sum value may hold at most this share of samples
    min_median_response: float = at_least(0, default=32)  # median loss-mask sum must reach this many tokens
    max_no_loss_share: float = within(0, 1, default=0.01)  # share of samples with no loss token at all
    max_empty_thinking_share: float = within(0, 1, default=0.50)  # share of samples whose thinking block is empty
    # share of samples with loss tokens on their prompt (before the assistant header, or on a turn's header)
    max_prompt_loss_share: float = within(0, 1, default=0.0)
    max_all_loss_share: float = within(0, 1, default=0.0)  # share of samples whose every token is under the loss
    # share of samples that repeat an earlier one token for token (copies of files or records)
    max_duplicate_share: float = within(0, 1, default=0.01)
    # share of samples with a loss run one token off (not starting on an answer's first token, or past <|im_end|>)
    max_loss_shift_share: float = within(0, 1, default=0.01)
    # share of samples with a loss run not ending on the end-of-turn token (<|im_end|>); cut samples aside
    max_end_of_turn_share: float = within(0, 1, default=0.01)
    # share of samples with loss tokens inside a turn that is not the assistant's (a tool result, a user turn)
    max_non_assistant_loss_share: float = within(0, 1, default=0.01)


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidateConfig:
    gate: GateConfig = field(default_factory=GateConfig)
    num_examples: int = at_least(0, default=3)  # decoded samples of the dominant mode and at random, each
    seed: int = 0
    # Offline hidden-state storage estimate: what training online avoids (Qwen3.6-27B defaults).
    num_feature_layers: int = at_least(1, default=5)
    hidden_size: int = at_least(1, default=5120)


def check_uri(uri: str, where: str) -> None:
    if is_hub_dataset(uri):
        parse(uri, field=where)


def check_sources(p: PromptsConfig) -> None:
    weighted = False
    for i, source in enumerate(p.sources):
        where = f"prompts.sources[{i}]"
        if not source.uri:
            raise DFlashError("empty; allowed: a file, folder, s3:// or hf://datasets/ URI", field=f"{where}.uri")
        check_uri(source.uri, f"{where}.uri")
        if source.count is not None and source.weight is not None:
            raise DFlashError(
                f"count={source.count} and weight={source.weight} both set; allowed: one of them "
                "(or neither: all of the source)",
                field=where,
            )
        if source.count is not None and source.count < 1:
            raise DFlashError(f"{source.count} is out of range; allowed: >= 1", field=f"{where}.count")
        if source.weight is not None and source.weight <= 0:
            raise DFlashError(f"{source.weight} is out of range; allowed: > 0", field=f"{where}.weight")
        weighted |= source.weight is not None
    if weighted and p.mix_total == 0:
        raise DFlashError(
            "0 with weighted sources; allowed: the number of prompts they give together (>= 1)",
            field="prompts.mix_total",
        )
    if p.mix_total and not weighted:
        raise DFlashError(
            f"{p.mix_total} but no source in prompts.sources has a weight; allowed: 0, or give sources weights",
            field="prompts.mix_total",
        )
