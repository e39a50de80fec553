"""Is one drafter recipe's tau above another's beyond noise? Seed spread and paired bootstrap
intervals over per-prompt, per-seed block counts (pure torch, no Ray).

Shapes: P prompts, S seeds (a seed: one training run of the recipe, or one draw of anything random in
scoring), R bootstrap resamples.

tau of a set of blocks is committed tokens over blocks, so an arm's tau is a ratio of sums over its
(prompt, seed) cells, never the mean of per-prompt taus (which would weigh a short answer's two
blocks as much as a long answer's hundred). The bootstrap resamples the units the result should
generalize over, prompts and seeds, independently (a crossed, "pigeonhole" bootstrap, mildly
conservative: it counts the cells' own noise twice); both arms take the same resampled cells, so
what the arms share (a hard prompt, a lucky seed) cancels in their difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class Decoded(Protocol):
    acceptance: list[int]  # tokens committed per block (`teacher_forced.Walk`, `speculative.Generation`)


@dataclass(frozen=True)
class Counts:
    """One arm's committed tokens and blocks per prompt and seed [P, S] (float64)."""

    tokens_PS: torch.Tensor
    blocks_PS: torch.Tensor

    @classmethod
    def of(cls, runs_SP: Sequence[Sequence[Decoded]]) -> Counts:
        """From decoded answers, one list of prompts per seed (the same prompts, in the same order)."""
        tokens = [[sum(d.acceptance) for d in seed] for seed in runs_SP]
        blocks = [[len(d.acceptance) for d in seed] for seed in runs_SP]
        return cls(torch.tensor(tokens, dtype=torch.float64).T, torch.tensor(blocks, dtype=torch.float64).T)

    @property
    def tau(self) -> float:
        return float(self.tokens_PS.sum() / self.blocks_PS.sum())

    def seed_taus(self) -> torch.Tensor:
        """[S] each seed's tau over every prompt."""
        return self.tokens_PS.sum(0) / self.blocks_PS.sum(0)


def seed_sd(arm: Counts) -> float:
    """The sample standard deviation of the seeds' taus (nan with one seed): how far a rerun moves tau."""
    return float(arm.seed_taus().std()) if arm.tokens_PS.shape[1] > 1 else float("nan")


@dataclass(frozen=True)
class Interval:
    estimate: float  # on the data as observed
    low: float
    high: float

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high


def paired_bootstrap(
    a: Counts,
    b: Counts,
    *,
    num_resamples: int = 10_000,
    level: float = 0.95,
    resample_seeds: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[Interval, Interval]:
    """Percentile intervals at `level` of tau(b) - tau(a) and of tau(b) / tau(a), both arms taking
    the same resampled (prompt, seed) cells. `resample_seeds` False: prompts alone (the seeds are
    fixed draws the claim is about). `generator` None: seed 0, so a report reproduces."""
    assert a.tokens_PS.shape == b.tokens_PS.shape, (a.tokens_PS.shape, b.tokens_PS.shape)
    P, S = a.tokens_PS.shape
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    prompts_RP = _draw_counts(num_resamples, P, g)
    seeds_RS = (
        _draw_counts(num_resamples, S, g) if resample_seeds else torch.ones(num_resamples, S, dtype=torch.float64)
    )

    def taus(arm: Counts) -> torch.Tensor:  # [R]: each resample's ratio of sums
        tokens = torch.einsum("rp,ps,rs->r", prompts_RP, arm.tokens_PS, seeds_RS)
        return tokens / torch.einsum("rp,ps,rs->r", prompts_RP, arm.blocks_PS, seeds_RS)

    tau_a, tau_b = taus(a), taus(b)
    tail = (1 - level) / 2
    q = torch.tensor([tail, 1 - tail], dtype=torch.float64)

    def interval(estimate: float, values: torch.Tensor) -> Interval:
        low, high = torch.quantile(values, q).tolist()
        return Interval(estimate, low, high)

    return interval(b.tau - a.tau, tau_b - tau_a), interval(b.tau / a.tau, tau_b / tau_a)


def _draw_counts(num_resamples: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """[R, n]: how many times each of n units is drawn in each resample of n with replacement."""
    picks = torch.randint(n, (num_resamples, n), generator=generator)
    return torch.zeros(num_resamples, n, dtype=torch.float64).scatter_add_(
        1, picks, torch.ones_like(picks, dtype=torch.float64)
    )
