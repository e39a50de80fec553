"""Held-out acceptance length after N steps: the drafter started from the target's layers against
the random start, side by side on the same run.

Both drafters train on the same samples in the same order with the same anchors (one drafter
worker each, the production `train_step`), on the features of one SmolLM2 target worker; then both
score the same held-out samples (whole prompts kept out) with the same anchors. Needs a tokenized
dataset of SmolLM2's own completions, e.g. a demo's `tokenized/` folder.

    .venv/bin/python -m bench.start --data demo-run/tokenized [--steps 500] [--heldout 48] [--set KEY=VALUE] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="tokenized dataset (file:// or s3://)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--heldout", type=int, default=48)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more settings")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from bench.side_by_side import train_side_by_side
    from dflash_ray.config import load_config
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.train.shape import drafter_config
    from dflash_ray.train.schedule import Schedule, dataset_samples, sample_prompts, split_heldout
    from dflash_ray.train.target_worker import TargetWorker
    from dflash_ray.train.workers import DrafterWorker

    # the demo's training settings, with both streams' samples in one batch
    cfg = load_config(
        None, ["train.num_anchors=32", "train.lr=3e-3", "train.loss_decay=2", "train.torch_threads=2", *args.set]
    )
    samples = dataset_samples(args.data)
    heldout, train = split_heldout(samples, args.heldout, cfg.train.seed, sample_prompts(samples))
    schedule = Schedule(train, 1, 2, cfg.train.seed)
    dcfg = drafter_config(SMOLLM2, cfg)
    target = TargetWorker(SMOLLM2, dcfg["dflash_config"]["target_layer_ids"], cfg.train)
    drafters = {mode: DrafterWorker(SMOLLM2, json.dumps(dcfg), mode, cfg.train, 0, 1) for mode in ("random", "target")}
    train_side_by_side(target, drafters, schedule, args.steps, "train both")
    held = [target.features([s]) for s in heldout]
    tau = {mode: statistics.fmean(t for b in held for t in worker.evaluate(b)) for mode, worker in drafters.items()}
    row = {
        "case": f"smollm2_{len(train)}samples_{args.steps}steps",
        "steps": args.steps,
        "heldout": len(heldout),
        "heldout_tau_random": round(tau["random"], 3),
        "heldout_tau_target": round(tau["target"], 3),
        "target_over_random": round(tau["target"] / tau["random"], 3),
    }
    print(json.dumps(row) if args.json else "\n".join(f"{k:>20}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
