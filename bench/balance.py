"""Straggler ratio of training steps before and after length balancing, side by side on one
long-tailed mix of lengths (log-normal, median 1,480 tokens, mean ~2,200, cut at 64 and 12,288 like
the Qwen3.6-27B preset's data), 8 streams of batch 1, the windowed order of 4 files (`Schedule`).

The ratio is the mean over an epoch's steps of the longest stream's target tokens over the mean
stream's: a step waits for its slowest target, so 1 is no waiting.

    .venv/bin/python -m bench.balance [--samples 20000] [--streams 8] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_ray.train.schedule import Schedule


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    lengths = torch.empty(args.samples).log_normal_(7.3, 0.9, generator=g).clamp(64, 12288).long().tolist()
    samples = [(f"part-{i % 64:05d}", i) for i in range(args.samples)]
    figures = {}
    for name, group in (("unbalanced", 0), ("balanced", args.streams)):
        schedule = Schedule(samples, args.streams, 1, seed=0, window=4, lengths=lengths, group=group)
        figures[name] = round(schedule.straggler_ratio(range(schedule.steps_per_epoch)), 3)
    figures["unbalanced_over_balanced"] = round(figures["unbalanced"] / figures["balanced"], 2)
    print(f"straggler_ratio_unbalanced: {figures['unbalanced']}")
    print(f"straggler_ratio_balanced: {figures['balanced']}")
    print(f"step_wait_unbalanced_over_balanced: {figures['unbalanced_over_balanced']:.2f}")
    if args.json:
        print(json.dumps({"mean_length": sum(lengths) / len(lengths), "streams": args.streams, **figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
