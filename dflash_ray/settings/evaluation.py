"""`evaluate` (stages/evaluate.py: real speculative decoding against the target, the simulated tau,
prompt lookup beside it) and `onesample` (stages/onesample.py: the one-answer overfit check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_ray.errors import DFlashError
from dflash_ray.settings.fields import above, at_least, within


@dataclass(frozen=True, kw_only=True, slots=True)
class EvaluateConfig:
    num_prompts: int = at_least(1, default=32)  # prompts decoded (the first ones of the prompt set)
    max_new_tokens: int = at_least(1, default=128, most=1 << 20)
    enable_thinking: bool = True  # chat-template flag for the prompts, as in training data
    dtype: Literal["float32", "bfloat16"] = "float32"  # target and drafter
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the GPU when the process sees one
    num_anchors: int = at_least(1, default=64)  # per held-out sequence, for the simulated tau
    num_heldout: int = at_least(1, default=64)  # held-out sequences scored
    # tau_sampled: speculative sampling at the serving temperature (0: skip)
    temperature: float = at_least(0, default=0.6, most=100)
    top_p: float = within(0, 1, low_open=True, default=0.95)
    ngram_min: int = at_least(1, default=2)  # n-gram prompt-lookup baseline
    ngram_max: int = at_least(1, default=4)
    seed: int = 0

    def check(self) -> None:
        if self.ngram_min > self.ngram_max:
            raise DFlashError(
                f"{self.ngram_min} is above evaluate.ngram_max={self.ngram_max}; allowed: <= ngram_max",
                field="evaluate.ngram_min",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class OneSampleConfig:
    """`dflash-ray onesample`: a drafter of the run's `train` settings overfit on one answer of the
    target's, then served on its prompt: any correct train → export → serve chain accepts whole blocks."""

    prompt: str = ""  # "": a bundled question; the target answers it greedily
    # the answer's length in whole blocks (after the prefill's token): what the drafter memorizes
    blocks: int = at_least(1, default=4)
    # training steps at most, stopping once every drafted token is predicted right
    steps: int = at_least(1, default=400)
    lr: float = above(0, default=3e-3, most=10)
    # pass: drafts accepted per block >= this x the drafts per block, output lossless
    min_share: float = within(0, 1, low_open=True, default=0.9)
    # with --engine vllm: vLLM's acceptance within this share of ours
    vllm_tolerance: float = within(0, 1, low_open=True, default=0.05)
