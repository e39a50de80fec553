"""Run greedy generation in vLLM with and without an exported DFlash drafter.

vLLM needs its own process (it spawns workers and wants a `__main__` guard), so this module is a
script: `python -m dflash_ray.drafter.vllm_check --target DIR --drafter DIR --prompts-json FILE`
prints one JSON object: the greedy outputs (with the drafter when given) and vLLM's measured mean
acceptance length (1 + accepted / drafts, from `llm.get_metrics()`); with `--temperature` also the
acceptance length of a sampled run (top-p `--top-p`) in the same engine; with `--plain` also the
greedy outputs without the drafter (`plain_outputs`), from an engine started first in the same
process. On the CPU the KV cache is sized in bytes for the machine, as for the generation engines.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import TokensPrompt


def vllm_decode(
    target_dir: str,
    drafter_dir: str | None,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    *,
    plain: bool = False,
) -> dict:
    """Greedy outputs from vLLM (with the drafter when given, and then its measured acceptance, and
    with `temperature` > 0 that of a sampled run too; `plain`: also those without the drafter, as
    `plain_outputs`), in vLLM's own process: it spawns workers and wants a `__main__` guard."""
    import os
    import subprocess
    import sys
    import tempfile

    from dflash_ray.errors import DFlashError

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    cmd = [
        sys.executable,
        "-m",
        "dflash_ray.drafter.vllm_check",
        "--target",
        target_dir,
        "--prompts-json",
        f.name,
        "--max-tokens",
        str(max_tokens),
        "--temperature",
        str(temperature),
        "--top-p",
        str(top_p),
    ]
    if drafter_dir:
        cmd += ["--drafter", str(drafter_dir)] + (["--plain"] if plain else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    line = next((x for x in done.stdout.splitlines() if x.startswith("VLLM_RESULT ")), None)
    if line is None:
        raise DFlashError(f"vLLM run failed: {done.stderr[-2000:]}", file=str(drafter_dir or target_dir))
    return json.loads(line[len("VLLM_RESULT ") :])


def _metric(metrics, name: str) -> float:
    total = 0.0
    for m in metrics:
        if m.name == name:
            total += float(getattr(m, "value", 0) or 0)
    return total


def _acceptance(llm, before: tuple[float, float]) -> tuple[dict, tuple[float, float]]:
    metrics = llm.get_metrics()
    now = (_metric(metrics, "vllm:spec_decode_num_drafts"), _metric(metrics, "vllm:spec_decode_num_accepted_tokens"))
    drafts, accepted = now[0] - before[0], now[1] - before[1]
    return {"drafts": drafts, "accepted": accepted, "acceptance_length": 1 + accepted / drafts if drafts else None}, now


def run(
    target: str,
    drafter: str | None,
    prompts: list[list[int]],
    max_tokens: int,
    dtype: str = "float32",
    num_speculative_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict:
    import torch

    from dflash_ray.config import GenerateConfig
    from dflash_ray.generation.cpu_engine import cpu_kv_cache_bytes, engine_in_process

    if not torch.cuda.is_available():
        engine_in_process()
    from vllm import SamplingParams

    from dflash_ray import hf_load

    kwargs: dict[str, Any] = {"enforce_eager": True, "max_model_len": 2048, "seed": 0, "dtype": dtype}
    if drafter:
        kwargs["disable_log_stats"] = False  # get_metrics() needs the stat loggers
        from dflash_ray.drafter.families import of_architecture

        config = json.loads(open(f"{drafter}/config.json").read())
        family = of_architecture(config.get("architectures", []))
        # the drafts of one block, as this project's decoding proposes them (`None`: the block's)
        drafts = num_speculative_tokens or config["block_size"] - family.first_prediction
        kwargs["speculative_config"] = {
            "method": family.vllm_method,
            "model": drafter,
            "num_speculative_tokens": drafts,
        }
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.25
    else:  # bytes for the prompts at once, within what this NUMA node has free
        sizing = GenerateConfig(
            max_model_len=2048,
            batch_size=len(prompts),
            dtype=dtype,
            engine_args={k: v for k, v in kwargs.items() if k == "speculative_config"},
        )
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(target, sizing)
    llm = hf_load.vllm_engine(target, **kwargs)
    requests: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    result: dict[str, Any] = {"outputs": [list(o.outputs[0].token_ids) for o in outputs]}
    if drafter:
        greedy, seen = _acceptance(llm, (0.0, 0.0))
        result.update(greedy)
        if temperature > 0:
            again: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
            llm.generate(
                again,
                [
                    SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=i)
                    for i in range(len(prompts))
                ],
                use_tqdm=False,
            )
            result["sampled"] = _acceptance(llm, seen)[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter")
    parser.add_argument("--prompts-json", required=True, help="a JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: also a sampled run")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--plain",
        action="store_true",
        help="with --drafter: first the same prompts without it, in this process (plain_outputs)",
    )
    args = parser.parse_args()
    prompts = json.load(open(args.prompts_json))
    plain = None
    if args.plain and args.drafter:  # one process, one import of vLLM, for both engines
        import gc

        plain = run(args.target, None, prompts, args.max_tokens)["outputs"]
        gc.collect()  # the first engine's memory goes before the second one sizes its cache
    result = run(args.target, args.drafter, prompts, args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    if plain is not None:
        result["plain_outputs"] = plain
    print("VLLM_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
