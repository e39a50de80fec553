"""`pretrain` (stages/pretrain.py): the drafter trained on raw text before distillation, from the
target's embedding and head alone (no target forward), with the run's `train` drafter settings."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ray.settings.fields import above, at_least, within


@dataclass(frozen=True, kw_only=True, slots=True)
class PretrainConfig:
    steps: int = at_least(
        1, default=1000, most=10**9
    )  # optimizer steps (the text is read again from its start when it runs out)
    # tokens per packed sequence: documents joined end to end (an end-of-text token between them), cut here
    seq_len: int = at_least(2, default=512, most=1 << 20)
    batch_size: int = at_least(1, default=4, most=1 << 16)  # packed sequences per step
    lr: float | None = above(0, default=None, most=10)  # None: train.lr
    warmup_ratio: float | None = within(0, 1, high_open=True, default=None)  # None: train.warmup_ratio
    # packed sequences shuffled together (a seeded order); 1: the text's own order
    shuffle_window: int = at_least(1, default=256, most=1 << 20)
    seed: int = 0  # the shuffle; the drafter's start and anchors take train.seed
