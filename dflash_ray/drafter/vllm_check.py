"""Run greedy generation in vLLM with and without an exported DFlash drafter.

vLLM needs its own process (it spawns workers and wants a `__main__` guard), so this module is a
script: `python -m dflash_ray.drafter.vllm_check --target DIR --drafter DIR --prompts-json FILE`
prints one JSON object: the outputs with and without the drafter and vLLM's measured mean
acceptance length (1 + accepted / drafts, from `llm.get_metrics()`).
"""

from __future__ import annotations

import argparse
import json


def _metric(metrics, name: str) -> float:
    total = 0.0
    for m in metrics:
        if m.name == name:
            total += float(getattr(m, "value", 0) or 0)
    return total


def run(target: str, drafter: str | None, prompts: list[list[int]], max_tokens: int, dtype: str = "float32",
        num_speculative_tokens: int = 15) -> dict:
    from vllm import LLM, SamplingParams

    # on CPU, gpu_memory_utilization is the share of host memory vLLM reserves (KV cache included)
    kwargs = {"enforce_eager": True, "max_model_len": 2048, "seed": 0, "gpu_memory_utilization": 0.25,
              "dtype": dtype}
    if drafter:
        kwargs["disable_log_stats"] = False  # get_metrics() needs the stat loggers
        kwargs["speculative_config"] = {"method": "dflash", "model": drafter,
                                        "num_speculative_tokens": num_speculative_tokens}
    llm = LLM(model=target, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outputs]}
    if drafter:
        metrics = llm.get_metrics()
        drafts = _metric(metrics, "vllm:spec_decode_num_drafts")
        accepted = _metric(metrics, "vllm:spec_decode_num_accepted_tokens")
        result.update(drafts=drafts, accepted=accepted,
                      acceptance_length=1 + accepted / drafts if drafts else None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter")
    parser.add_argument("--prompts-json", required=True, help="a JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    prompts = json.load(open(args.prompts_json))
    print("VLLM_RESULT " + json.dumps(run(args.target, args.drafter, prompts, args.max_tokens)))


if __name__ == "__main__":
    main()
