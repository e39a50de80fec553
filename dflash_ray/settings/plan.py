"""`plan`: what `dflash-ray plan` projects (stages/plan.py, planning.py, simulate*.py): the workload,
the cluster, measured rates, storage and failure rates, prices. Every number is bounded on both
sides: a rate of 1e-300 GB/s or 1e300 GPUs would plan a wall time that is no number.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dflash_ray.errors import DFlashError
from dflash_ray.gpus import GPUS
from dflash_ray.settings.fields import within

PLAN_GPUS = tuple(GPUS)  # those whose memory and peaks the plan knows
GB_PER_S = (0.001, 1000)  # a storage, disk or checkpoint rate a plan takes: 1 MB/s to 1 TB/s


def off_or(spec: Any) -> Any:
    """A ranged field (`within`) that also takes 0, the field's "not given" (its comment says what
    stands in): 1e-300 is no measured rate, and a figure priced at it would not be finite."""
    ok, allowed = spec.metadata["range"]
    return dataclasses.field(
        default=spec.default, metadata={**spec.metadata, "range": (lambda v: v == 0 or ok(v), f"{allowed}, or 0")}
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """What `dflash-ray plan` projects: the seed's workload on the cluster given here."""

    cluster: str = ""  # a cluster launcher YAML: GPUs of node types with gen_node / train_node resources
    generation_gpus: int = within(1, 1_000_000, default=32)  # used when no cluster file is given
    training_gpus: int = within(1, 1_000_000, default=16)
    prompts: int = within(1, 10**8, default=902_087)
    output_tokens: float = within(1, 10**15, default=1.64e9)
    train_tokens: float = within(1, 10**15, default=1.87e9)  # prompt + response tokens of one epoch
    epochs: int = within(1, 10_000, default=6)
    # measured output tokens/s per generation GPU (your engines); 0: the engines simulated from generate's
    # settings and the target's config (simulate_generation.py)
    generation_tokens_per_s_per_gpu: float = off_or(within(0.01, 10**7, default=0.0))
    # the responses' mean length before generate.max_tokens cuts them (exponential); 0: output_tokens / prompts
    response_mean_tokens: float = off_or(within(1, 10**7, default=0.0))
    # share of the GPUs' roofline (memory bandwidth for decode, bf16 peak for prefill) vLLM reaches
    generation_roofline_share: float = within(0.001, 1, default=0.5)
    # measured (bench.train on your GPUs); 0: the simulated step
    training_tokens_per_s_per_gpu: float = off_or(within(0.01, 10**8, default=0.0))
    gpu: str = "H200"  # the training and generation nodes' GPU: H100, H200 or B200 (its memory and peaks)
    target_config: str = ""  # the target's config.json (or folder, or a bundled name); "": the run's target
    # a completions or tokenized dataset (e.g. a sample regenerated first): its lengths give generation's
    # prompts and responses, and a tokenized one the training steps' straggler ratio
    dataset: str = ""
    # GB/s of all-reduce bus bandwidth between the drafters' nodes (`dflash-ray netcheck`'s figure);
    # 0: train.min_bus_bandwidth, the least a run accepts
    bus_bandwidth: float = off_or(within(0.001, 10_000, default=0.0))
    # GB/s of all-reduce bus bandwidth between the GPUs of one node (NVLink); 0: the GPU's figure
    node_bus_bandwidth: float = off_or(within(0.001, 10_000, default=0.0))
    gpus_per_node: int = within(1, 1024, default=8)  # the training nodes' GPUs (a node's drafter ranks shard together)
    # GB/s a node reads the target's folder from storage at, in ranged reads run at once
    # (DFLASH_RAY_S3_CONCURRENCY of DFLASH_RAY_S3_CHUNK_MB each); `dflash-ray netcheck --storage URI` measures it
    storage_gb_per_s: float = within(*GB_PER_S, default=1.0)
    # GB/s a GPU's process reads the target's weights from the node's disk at
    load_gb_per_s: float = within(*GB_PER_S, default=1.0)
    checkpoint_gb_per_s: float = within(*GB_PER_S, default=1.0)  # a drafter rank writes its checkpoint shard
    # a vLLM engine's start past loading its weights; 0: none
    engine_start_s: float = off_or(within(0.001, 86_400, default=120.0))
    # interruptions per GPU-hour a restart recovers from (Llama 3's 54 days on 16,384 H100s: 419 unexpected)
    failures_per_gpu_hour: float = off_or(within(1e-9, 1, default=2e-5))
    dollars_per_gpu_hour: float = off_or(within(0.001, 10_000, default=0.0))  # 0: no cost figure
    # share of the GPU's memory a role's simulated steady-state peak may take. The simulation is 1.046x
    # the H200's max_memory_allocated for the code measured (bench.simulate), so a peak needs no
    # scaling up; the 10% left is what max_memory_allocated does not count: the CUDA context and
    # NCCL's buffers (1-3 GB) and the caching allocator's fragmentation (reserved over allocated)
    memory_headroom: float = within(0.1, 1, default=0.9)

    def check(self) -> None:
        if self.gpu not in PLAN_GPUS:
            raise DFlashError(f"{self.gpu!r} is not one of {list(PLAN_GPUS)}", field="plan.gpu")
