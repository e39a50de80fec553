"""Generation throughput on CPU: vLLM generator actors against the transformers backend, and the
scaling of 2 vLLM generators over 1, and vLLM's default dtype (`generate.dtype=auto`: fp32 on a CPU
without native bf16) against bf16, on the same prompts and the same model (SmolLM2-135M-Instruct).

Each case is one real `run_generate` (pool, generator actors, shards written to local storage);
tokens/s is the pool's figure: output tokens from the first shard lease to the last completed shard,
so engine start-up (~30 s for vLLM) is left out of every case alike. Printed: one ratio per line.

    .venv/bin/python -m bench.generate [--prompts 27] [--max-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json

from bench.scratch import scratch


def _case(prompts: str, work: str, name: str, overrides: list[str]) -> dict:
    from dflash_ray.config import load_config
    from dflash_ray.registry import SMOLLM2
    from dflash_ray.stages.generate import run_generate

    cfg = load_config(None, [f"generate.name=bench-{name}", *overrides])
    summary = run_generate(prompts, f"{work}/{name}", SMOLLM2, cfg, progress=False)
    return {k: summary[k] for k in ("tokens_per_s", "output_tokens", "prompts", "seconds", "generators_started")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=27, help="the first N bundled demo prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=8, help="prompts per shard = sequences per vLLM call")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from bench.local_ray import local_ray
    from dflash_ray.config import load_config
    from dflash_ray.stages.prompts import run_prompts
    from dflash_ray.stages.demo import bundled_inputs
    from dflash_ray.registry import SMOLLM2

    work = scratch("bench-generate-")
    cfg = load_config(None, [f"prompts.tokenizer={SMOLLM2}", f"prompts.shard_size={args.prompts}"])
    run_prompts(bundled_inputs(), f"{work}/all", cfg, progress=False)
    from dflash_ray import manifest, storage
    from dflash_ray.stages.prompts import shard_bytes

    storage.write_bytes(f"{work}/prompts.parquet", shard_bytes(manifest.read_rows(f"{work}/all", None, args.prompts)))
    prompts = f"{work}/prompts.parquet"
    common = [
        f"generate.max_tokens={args.max_tokens}",
        "generate.max_model_len=2048",
        "generate.truncated=keep",
        f"generate.shard_size={args.shard_size}",
        "generate.temperature=0.6",
    ]
    with local_ray(num_cpus=2):
        cases = {
            "vllm_1": _case(prompts, work, "vllm1", common + ["generate.generators=1"]),
            "vllm_2": _case(prompts, work, "vllm2", common + ["generate.generators=2"]),
            "vllm_1_bf16": _case(
                prompts, work, "vllm1-bf16", common + ["generate.generators=1", "generate.dtype=bfloat16"]
            ),
            "transformers_1": _case(
                prompts, work, "hf1", common + ["generate.generators=1", "generate.backend=transformers"]
            ),
        }
    result = {
        "vllm_over_transformers": round(cases["vllm_1"]["tokens_per_s"] / cases["transformers_1"]["tokens_per_s"], 2),
        "two_generators_over_one": round(cases["vllm_2"]["tokens_per_s"] / cases["vllm_1"]["tokens_per_s"], 2),
        "auto_dtype_over_bf16": round(cases["vllm_1"]["tokens_per_s"] / cases["vllm_1_bf16"]["tokens_per_s"], 2),
        "cases": cases,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"vllm_over_transformers: {result['vllm_over_transformers']}")
        print(f"two_generators_over_one: {result['two_generators_over_one']}")
        print(f"auto_dtype_over_bf16: {result['auto_dtype_over_bf16']}")
        for name, case in cases.items():
            print(f"{name}: {json.dumps(case)}")


if __name__ == "__main__":
    main()
