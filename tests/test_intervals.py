"""Seed spread and paired bootstrap intervals of tau on synthetic counts whose answer is known."""

import math

import torch

from dflash_ray.drafter.intervals import Counts, paired_bootstrap, seed_sd
from dflash_ray.drafter.teacher_forced import Walk


def _arm(P=40, S=3, seed=0) -> Counts:
    """Blocks per cell 5..40; tau per cell around 3 with prompt and seed effects."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(5, 41, (P, S), generator=g).double()
    tau = 3 + torch.randn(P, 1, generator=g) * 0.8 + torch.randn(1, S, generator=g) * 0.1
    return Counts((blocks * tau.clamp(min=1)).round(), blocks)


def test_tau_is_a_ratio_of_sums_and_counts_come_from_decoded_blocks():
    # a short answer at tau 4 and a long one at tau 1: pooled 7/4, not the taus' mean 2.5
    arm = Counts.of([[Walk([(3, 3)], [4]), Walk([(3, 0)] * 3, [1, 1, 1])]])
    assert arm.tokens_PS.tolist() == [[4.0], [3.0]] and arm.blocks_PS.tolist() == [[1.0], [3.0]]
    assert arm.tau == 7 / 4


def test_seed_sd_is_the_spread_of_the_seeds_taus():
    blocks = torch.full((2, 3), 10.0, dtype=torch.float64)
    tokens = blocks * torch.tensor([2.0, 3.0, 4.0], dtype=torch.float64)  # seed taus 2, 3, 4
    assert math.isclose(seed_sd(Counts(tokens, blocks)), 1.0)
    assert math.isnan(seed_sd(Counts(tokens[:, :1], blocks[:, :1])))


def test_identical_arms_straddle_no_difference():
    a = _arm()
    diff, ratio = paired_bootstrap(a, a, num_resamples=2000)
    assert not diff.excludes(0) and not ratio.excludes(1) and diff.estimate == 0


def test_same_tau_other_noise_straddles_no_difference():
    # arm b: the same prompts and seeds at the same tau per cell, with its own blocks per cell
    a = _arm()
    b = _arm(seed=1)
    b = Counts(b.blocks_PS * (a.tokens_PS / a.blocks_PS), b.blocks_PS)
    diff, ratio = paired_bootstrap(a, b, num_resamples=2000)
    assert not diff.excludes(0) and not ratio.excludes(1), (diff, ratio)


def test_a_clear_shift_is_excluded():
    # b: a's tau + 0.3 in every cell, plus noise of its own (sd 0.5 per cell); prompts alone spread
    # tau by 0.8, which pairing takes out of the difference
    a = _arm()
    noise = torch.randn(a.blocks_PS.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    b = Counts(a.tokens_PS + (0.3 + 0.5 * noise) * a.blocks_PS, a.blocks_PS)
    diff, ratio = paired_bootstrap(a, b, num_resamples=2000)
    assert diff.excludes(0) and ratio.excludes(1), (diff, ratio)
    assert diff.low <= 0.3 <= diff.high and diff.low <= diff.estimate <= diff.high, diff
    assert ratio.low <= ratio.estimate <= ratio.high and math.isclose(ratio.estimate, b.tau / a.tau)


def test_a_fixed_generator_is_deterministic():
    a, b = _arm(), _arm(seed=1)
    first = paired_bootstrap(a, b, num_resamples=500, generator=torch.Generator().manual_seed(7))
    again = paired_bootstrap(a, b, num_resamples=500, generator=torch.Generator().manual_seed(7))
    assert first == again
    assert paired_bootstrap(a, b, num_resamples=500) == paired_bootstrap(a, b, num_resamples=500)  # seed 0
    prompts_only = paired_bootstrap(a, b, num_resamples=500, resample_seeds=False)
    assert prompts_only[0].estimate == first[0].estimate and prompts_only != first
