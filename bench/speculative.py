"""Speculative decoding with a DFlash drafter against the SmolLM2-135M-Instruct target alone, on CPU.

Greedy, batch 1, on the bundled demo prompts: tau (tokens per verify step), tokens/s of both, the
speedup, and the n-gram prompt-lookup baseline's tau on the same outputs. Without `--drafter` a
freshly initialized (untrained) drafter is measured: the floor any trained drafter must beat.

    .venv/bin/python -m bench.speculative [--drafter DIR] [--prompts 8] [--max-new-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json

from bench.scratch import scratch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", help="exported drafter folder (default: an untrained one)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig

    from dflash_ray.config import load_config
    from dflash_ray.stages.prompts import run_prompts
    from dflash_ray.stages.demo import bundled_inputs
    from dflash_ray.drafter.config import from_target
    from dflash_ray.drafter.export import save_drafter
    from dflash_ray.drafter.model import DFlashDrafter
    from dflash_ray.stages.evaluate import run_evaluate
    from dflash_ray.registry import SMOLLM2, resolve

    work = scratch("bench-spec-")
    cfg = load_config(
        None,
        [
            f"evaluate.num_prompts={args.prompts}",
            f"evaluate.max_new_tokens={args.max_new_tokens}",
            f"prompts.tokenizer={SMOLLM2}",
        ],
    )
    run_prompts(bundled_inputs(small=True), f"{work}/prompts", cfg, progress=False)
    drafter_dir = args.drafter
    if drafter_dir is None:
        target_cfg = AutoConfig.from_pretrained(resolve(SMOLLM2))
        torch.manual_seed(0)
        drafter_dir = f"{work}/untrained"
        save_drafter(
            DFlashDrafter(from_target(target_cfg, mask_token_id=49151, num_layers=1)), drafter_dir, dtype=torch.float32
        )
    summary = run_evaluate(drafter_dir, SMOLLM2, f"{work}/prompts", cfg)
    row = {
        "case": "smollm2_greedy_cpu",
        "drafter": args.drafter or "untrained",
        **{
            k: summary[k]
            for k in (
                "prompts",
                "tokens",
                "tau",
                "tau_ngram",
                "tokens_per_s",
                "target_tokens_per_s",
                "speedup",
                "lossless",
            )
        },
    }
    print(json.dumps(row) if args.json else "\n".join(f"{k:>20}: {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
