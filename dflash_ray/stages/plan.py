"""`dflash-ray plan`: GPU-hours and wall time of generation and training for a workload (the seed's
by default: 902K prompts, 1.64B output tokens, 6 epochs) on the cluster in the config, and the
offline hidden-state storage that online training avoids.

Generation runs at a measured rate per GPU (the seed's engines by default). Training uses a
measured rate when given (`plan.training_tokens_per_s_per_gpu`, e.g. from `bench.train` on the
target GPUs); otherwise a FLOP model, said so in the output: per sequence token the target's forward
(2·P_target) plus the drafter's forward and backward (6·P_drafter) over anchors × block_size block
tokens per sequence, at `mfu` of the GPU's peak.
"""

from __future__ import annotations

from typing import Any

import yaml

from dflash_ray import storage
from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError


def train_flops_per_token(target_params: float, drafter_params: float, head_params: float,
                          block_tokens_per_token: float) -> float:
    """Model FLOPs of one training step per sequence token (attention scores left out)."""
    return 2 * target_params + (6 * drafter_params + 4 * head_params) * block_tokens_per_token


def cluster_gpus(uri: str) -> tuple[int, int]:
    """(generation GPUs, training GPUs) at the node types' max_workers in a cluster launcher YAML."""
    try:
        cfg = yaml.safe_load(storage.read_bytes(uri))
        types = cfg["available_node_types"]
    except (yaml.YAMLError, KeyError, TypeError) as e:
        raise DFlashError(f"not a cluster launcher config: {e}", file=uri) from None
    gen = train = 0
    for name, node in types.items():
        resources = node.get("resources") or {}
        gpus = int(resources.get("GPU", 0)) * int(node.get("max_workers", 0))
        if resources.get("gen_node"):
            gen += gpus
        if resources.get("train_node"):
            train += gpus
    if not gen or not train:
        raise DFlashError("needs node types with `gen_node` and `train_node` resources and GPUs", file=uri)
    return gen, train


def run_plan(cfg: RunConfig) -> dict[str, Any]:
    from dflash_ray.preflight import preflight

    warnings = preflight(cfg)  # every check a run of this config makes before it starts
    p = cfg.plan
    gen_gpus, train_gpus = cluster_gpus(p.cluster) if p.cluster else (p.generation_gpus, p.training_gpus)
    if gen_gpus < 1 or train_gpus < 1:
        raise DFlashError("needs at least one GPU for each stage", field="plan.generation_gpus")
    gen_gpu_h = p.output_tokens / p.generation_tokens_per_s_per_gpu / 3600

    seq_len = p.train_tokens / p.prompts
    if p.training_tokens_per_s_per_gpu > 0:
        train_rate, source = p.training_tokens_per_s_per_gpu, "measured (plan.training_tokens_per_s_per_gpu)"
    else:
        block_tokens_per_token = min(p.anchors, seq_len) * p.block_size / seq_len
        flops = train_flops_per_token(p.target_params, p.drafter_params, p.head_params, block_tokens_per_token)
        train_rate = p.gpu_tflops * 1e12 * p.mfu / flops
        source = f"FLOP model: {flops / 1e9:.0f} GFLOP per token at {p.mfu:.0%} of {p.gpu_tflops:.0f} TFLOP/s"
    train_gpu_h = p.train_tokens * p.epochs / train_rate / 3600
    v = cfg.validate
    offline = p.train_tokens * v.num_feature_layers * v.hidden_size * 2  # bf16 features of every token
    return {
        "stage": "plan", "cluster": p.cluster or None,
        "workload": {"prompts": p.prompts, "output_tokens": p.output_tokens, "train_tokens": p.train_tokens,
                     "epochs": p.epochs},
        "generation": {"gpus": gen_gpus, "tokens_per_s_per_gpu": p.generation_tokens_per_s_per_gpu,
                       "gpu_hours": round(gen_gpu_h, 1), "wall_hours": round(gen_gpu_h / gen_gpus, 2)},
        "training": {"gpus": train_gpus, "tokens_per_s_per_gpu": round(train_rate, 1), "rate_source": source,
                     "gpu_hours": round(train_gpu_h, 1), "wall_hours": round(train_gpu_h / train_gpus, 2)},
        "offline_storage_avoided_tb": round(offline / 1e12, 1),
        "offline_storage_note": f"{v.num_feature_layers} layers x hidden {v.hidden_size} x 2 bytes per token, "
                                "written once and read every epoch",
        "warnings": warnings,
    }
