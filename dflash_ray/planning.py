"""The plan's library: the target a plan is for (bundled configs, a fallback named as such), the
GPU, the samples at the longest and mean lengths, each GPU role's real step code simulated under
fake tensors (`simulate`) and checked against the GPU's memory. `dflash-ray plan` (`stages/plan.py`)
composes them with generation's and the job's simulation; `train` runs `check_memory` before a GPU
run starts.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from dflash_ray import storage
from dflash_ray.cluster_file import count_gpus
from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError
from dflash_ray.settings.loading import read_yaml

# Calibrated on the one H200 run of the GPU check (bench/RESULTS.md, 2026-11-30): the colocated step's
# FLOPs counted at its shapes (138.6 TFLOP, the target's attention included) over its measured target
# and drafter seconds (0.328 s) on a 989 TFLOP/s peak; its AdamW (the multi-tensor path, 7 passes over
# 6.9 GB of fp32 weights) over its 0.041 s on 4.8 TB/s.
COMPUTE_EFFICIENCY = 0.427
OPTIMIZER_BANDWIDTH_EFFICIENCY = 0.25
OPTIMIZER_PASSES = 7  # AdamW reads the weight, gradient and both moments and writes three of them
ESTIMATOR = (
    f"counted FLOPs at {COMPUTE_EFFICIENCY:.1%} of the GPU's dense bf16 peak, plus AdamW's "
    f"{OPTIMIZER_PASSES} passes over the rank's fp32 shard at {OPTIMIZER_BANDWIDTH_EFFICIENCY:.0%} of its "
    "memory bandwidth; both shares calibrated on the H200 GPU check of 2026-11-30 (bench/RESULTS.md)"
)
# targets a plan needs no copy of: their config.json ships in dflash_ray/assets/targets, found by
# the bundled name or by the Hub id (`pipeline.target: Qwen/Qwen3-8B` plans with it offline)
BUNDLED_TARGETS = {"qwen3.6-27b": "Qwen/Qwen3.6-27B", "qwen3-8b": "Qwen/Qwen3-8B"}
DEFAULT_TARGET = "qwen3.6-27b"  # the seed workload's target


def cluster_gpus(uri: str) -> tuple[int, int]:
    """(generation GPUs, training GPUs) at the node types' max_workers in a cluster launcher YAML."""
    return count_gpus(read_yaml(uri), uri)


@functools.cache
def _config_from_json(text: str, where: str):
    from transformers import AutoConfig

    try:
        data = json.loads(text)
    except ValueError as e:
        raise DFlashError(f"not a model config.json: {e}", file=where) from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise DFlashError("not a model config.json: it needs a `model_type`", file=where, field="model_type")
    try:
        config = AutoConfig.for_model(**data)
    except Exception as e:  # transformers' own validation of the fields (its error types vary by version)
        reason = str(e).split(". Should contain")[0]  # not transformers' list of every model type
        raise DFlashError(
            f"not a model config.json transformers knows: {reason}", file=where, field="model_type"
        ) from None
    text_config = getattr(config, "text_config", None) or config
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        value = getattr(text_config, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DFlashError(f"{value!r}: a model's sizes are whole numbers >= 1", file=where, field=key)
    return config


def target_config(cfg: RunConfig, target: str = "") -> tuple[Any, str]:
    """The target's config and where it came from: the run's own `target` when given, else
    `plan.target_config` (a bundled name, a config.json or a model folder), else `pipeline.target`,
    else the seed's."""
    source = target or cfg.plan.target_config or cfg.pipeline.target or DEFAULT_TARGET
    bundled = next((name for name, hub in BUNDLED_TARGETS.items() if source in (name, hub)), None)
    if bundled is not None:
        from importlib import resources

        path = resources.files("dflash_ray.assets").joinpath("targets", f"{bundled}.json")
        hub = BUNDLED_TARGETS[bundled]
        return _config_from_json(path.read_text(), bundled), f"{bundled} (bundled config.json of {hub})"
    if source.endswith(".json"):
        return _config_from_json(storage.read_bytes(source).decode(), source), source
    from dflash_ray.train.shape import target_config as resolved

    try:
        return resolved(source), source
    except (ValueError, OSError) as e:  # a folder without a config.json, or one transformers cannot read
        raise DFlashError(
            f"no model config.json transformers can read: {str(e).splitlines()[0]}", file=source
        ) from None


def fallback_warning(cfg: RunConfig, target: str = "") -> list[str]:
    """The warning a plan gives when nothing names the run's target and it plans the seed's."""
    if target or cfg.plan.target_config or cfg.pipeline.target:
        return []
    hub = BUNDLED_TARGETS[DEFAULT_TARGET]
    return [
        f"no plan.target_config or pipeline.target names this run's target: the plan falls back to "
        f"{hub}'s config (the seed's target), whose memory, time and cost are not your target's; set "
        f"plan.target_config (a bundled name: {', '.join(BUNDLED_TARGETS)}; a config.json; or a model "
        "folder)"
    ]


def target_summary(hf, weights_gb: float) -> dict[str, Any]:
    """The planned target's shape, as its config.json gives it."""
    text = getattr(hf, "text_config", None) or hf
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    return {
        "model_type": text.model_type,
        "layers": text.num_hidden_layers,
        "attention_layers": kinds.count("full_attention") + kinds.count("sliding_attention"),  # the rest linear
        "hidden_size": text.hidden_size,
        "intermediate_size": getattr(text, "intermediate_size", None),
        "vocab_size": text.vocab_size,
        "parameters_b": round(weights_gb / 2, 2),  # its bf16 weights
    }


def gpu_of(cfg: RunConfig):
    from dflash_ray.gpus import GPUS

    return GPUS[cfg.plan.gpu]


# -- the simulated roles -------------------------------------------------------------------------


def samples(cfg: RunConfig):
    """(longest, mean) sequences a stream steps on: the longest the config keeps (its prompt what the
    longest answer leaves room for), and the workload's mean with its prompt share."""
    from dflash_ray.simulate import Sample

    longest = cfg.tokenize.max_seq_len
    prompt = max(1, min(longest - cfg.generate.max_tokens, cfg.prompts.max_prompt_tokens, longest // 2))
    p = cfg.plan
    per_sample = p.train_tokens / p.prompts
    if per_sample < 2 or p.output_tokens > p.train_tokens:
        raise DFlashError(
            f"plan.train_tokens={p.train_tokens:g} over plan.prompts={p.prompts:g} is {per_sample:.3g} tokens a "
            f"sample (output_tokens {p.output_tokens:g}): allowed: at least 2 tokens a sample, with "
            "output_tokens <= train_tokens",
            field="plan.prompts",
        )
    mean = max(2, round(per_sample))
    mean_prompt = max(1, round(mean * (1 - p.output_tokens / p.train_tokens)))
    batch = cfg.train.batch_size
    return Sample(longest, prompt, batch), Sample(mean, mean_prompt, batch)


def team_drafters(cfg: RunConfig, hf, serving: dict[str, dict] | None = None) -> list[tuple[str, RunConfig, Any]]:
    """(name, settings, shape) of each drafter of the run; `serving`: each one's `drafter_config` by
    name, where the run resolved them (`preflight.resolve_run`), else derived from `hf`."""
    from dflash_ray.drafter.export import from_hf_config
    from dflash_ray.train.shape import drafter_config_of
    from dflash_ray.train import drafters

    return [
        (name, team, from_hf_config(serving[name] if serving is not None else drafter_config_of(hf, team)))
        for name, team in drafters.expand(cfg)
    ]


@functools.lru_cache(maxsize=32)
def _target_step(hf_json: str, layers: tuple, seq: int, prompt: int, batch: int, top_k: int, last: bool) -> dict:
    from transformers import AutoConfig

    from dflash_ray.simulate import Sample, target_forward

    hf = AutoConfig.for_model(**json.loads(hf_json))
    return target_forward(hf, list(layers), Sample(seq, prompt, batch), top_k, last)


@functools.lru_cache(maxsize=64)
def _drafter_step(
    dcfg_json: str,
    seq: int,
    prompt: int,
    batch: int,
    anchors: int,
    world: int,
    tied: bool,
    top_k: int,
    distill: float,
    gamma: float | None,
    bucket: int,
    zero_grad_first: bool = True,
    replicas: int = 1,
    reduce_bf16: bool = False,
    keep_gathered: bool = False,
) -> dict:
    import torch

    from dflash_ray.drafter.export import from_hf_config
    from dflash_ray.simulate import Sample, drafter_step

    dcfg = from_hf_config(json.loads(dcfg_json))
    return drafter_step(
        dcfg,
        dcfg.family,
        Sample(seq, prompt, batch),
        num_anchors=anchors,
        world=world,
        replicas=replicas,
        reduce_dtype=torch.bfloat16 if reduce_bf16 else torch.float32,
        keep_gathered=keep_gathered,
        tied_head=tied,
        teacher_k=top_k,
        distill=distill,
        gamma=gamma,
        length_bucket=bucket,
        zero_grad_first=zero_grad_first,
    )


@dataclass(frozen=True)
class Sharding:
    """How the drafters' ranks hold the weights on the GPUs (`train/mesh.py`): the kind, drafter
    ranks to a node, gradients reduced in bf16, layers kept gathered from forward to backward."""

    kind: str
    per_node: int
    reduce_bf16: bool
    keep_gathered: bool

    def shape(self, ranks: int) -> tuple[int, int]:
        """(replicas, shard size) over `ranks` ranks."""
        from dflash_ray.train.mesh import shape_of

        return shape_of(self.kind, ranks, self.per_node) if ranks > 1 else (1, 1)


def sharding_of(cfg: RunConfig, kind: str = "") -> Sharding:
    """The sharding a GPU run of `cfg` takes: `kind` (else train.layout, whose `auto`
    `layout_choice.choose` refines), its nodes' GPUs, and the gradients' and gathers' settings."""
    from dflash_ray.train.mesh import kind_of

    tr, p = cfg.train, cfg.plan
    return Sharding(
        kind=kind_of(kind or tr.layout),
        per_node=max(1, p.gpus_per_node // stream_gpus(cfg)),
        reduce_bf16=tr.reduce_dtype != "float32",  # auto: the compute dtype, bf16 on a GPU
        keep_gathered=bool(tr.keep_gathered),
    )


def stream_gpus(cfg: RunConfig) -> int:
    """GPUs one stream holds: its colocated actor's, or its target's and each drafter's."""
    from dflash_ray.train.devices import target_gpus

    tr = cfg.train
    if tr.colocate:
        return 1
    return max(1, int(target_gpus(tr) or 1)) + max(1, len(tr.drafters))


def simulate_roles(
    cfg: RunConfig,
    hf,
    sample,
    zero_grad_first: bool = True,
    sharding: Sharding | None = None,
    serving: dict[str, dict] | None = None,
) -> dict[str, dict]:
    """Each GPU role's step at `sample`: memory by category per GPU at the drafters' steady-state
    peak, FLOPs (and the decoder layers' share), the bytes each mesh dimension's collectives send a
    step, and seconds on `plan.gpu`. `zero_grad_first`: where the drafter's step frees last step's
    gradients (`simulate.drafter_step`); `sharding`: the drafters' (`sharding_of` by default);
    `serving`: the drafters' resolved shapes (`team_drafters`)."""
    import torch

    from dflash_ray.drafter.export import to_hf_config
    from dflash_ray.train.devices import target_gpus
    from dflash_ray.train.drafters import target_sends, union_layers
    from dflash_ray.train.mesh import dims_cross_nodes

    tr, gpu = cfg.train, gpu_of(cfg)
    sharding = sharding or sharding_of(cfg)
    teams = team_drafters(cfg, hf, serving)
    layers, _ = union_layers([list(d.target_layer_ids) for _, _, d in teams])
    distilled = [t.train.distill > 0 and not d.settings.wants_target_distribution() for _, t, d in teams]
    top_k, last = target_sends(tr)
    hf_json = json.dumps(hf.to_dict(), sort_keys=True, default=str)
    target = dict(_target_step(hf_json, tuple(layers), sample.seq_len, sample.prompt_len, sample.batch, top_k, last))
    spread = max(1, int(target_gpus(tr) or 1))
    target_memory = {k: round(v / spread, 2) for k, v in target["memory_gb"].items()}
    roles = {
        "target": {
            "gpus": spread,
            "memory_gb": target_memory,
            "flops_per_step": target["flops_per_step"],
            "step_seconds": _seconds(target["flops_per_step"], 0, gpu) / spread,
            "weights_gb": target["memory_gb"]["parameters"],  # whole, over all its GPUs
            "simulated_in_s": target["simulated_in_s"],
        }
    }
    tied = bool(getattr(getattr(hf, "text_config", hf), "tie_word_embeddings", False))
    for (name, team, dcfg), wanted in zip(teams, distilled):
        t = team.train
        replicas, shard = sharding.shape(t.num_streams)
        step = _drafter_step(
            json.dumps(to_hf_config(dcfg, torch.float32), sort_keys=True),
            sample.seq_len,
            sample.prompt_len,
            sample.batch,
            t.num_anchors,
            replicas * shard,
            tied,
            top_k if wanted else 0,
            t.distill,
            t.loss_decay,
            t.length_bucket,
            zero_grad_first,
            replicas,
            sharding.reduce_bf16,
            sharding.keep_gathered,
        )
        shard_gb = step["parameters"] * 4 / shard / 1e9
        crosses = dims_cross_nodes(sharding.kind, t.num_streams, sharding.per_node)
        role = {
            "gpus": 1,
            "memory_gb": dict(step["memory_gb"]),
            "flops_per_step": step["flops_per_step"],
            "step_seconds": _seconds(step["flops_per_step"], shard_gb, gpu),
            "layer_seconds": _seconds(step["layer_flops_per_step"], 0, gpu),
            "fsdp_units": dcfg.num_layers + 1,
            "parameters": step["parameters"],
            "simulated_in_s": step["simulated_in_s"],
        }
        if t.num_streams > 1:  # counted from the step's own collectives (`simulate_traffic`), priced at the
            # bus of each mesh dimension: simulate_job.training_step
            role["traffic"] = {
                dim: {"gb": gb, "crosses_nodes": crosses.get(dim, True)} for dim, gb in step["traffic_gb"].items()
            }
            role["collective_gb_per_step"] = float(f"{sum(step['traffic_gb'].values()):.4g}")
        roles[f"drafter:{name}" if name else "drafter"] = role
    if tr.colocate:  # one GPU holds both: the drafter's step runs after the target's forward
        drafter = roles.pop("drafter")
        target = roles.pop("target")
        memory = {
            k: round(drafter["memory_gb"].get(k, 0) + (target["memory_gb"].get(k, 0) if k != "activations" else 0), 2)
            for k in drafter["memory_gb"]
        }
        memory["total"] = round(sum(v for k, v in memory.items() if k != "total"), 2)
        roles["stream"] = {
            **drafter,
            "memory_gb": memory,
            "flops_per_step": drafter["flops_per_step"] + target["flops_per_step"],
            "step_seconds": drafter["step_seconds"] + target["step_seconds"],
            "target_seconds": target["step_seconds"],
            "target_flops": target["flops_per_step"],
            "weights_gb": target["weights_gb"],
        }
    return roles


def _seconds(flops: float, optimizer_shard_gb: float, gpu) -> float:
    compute = flops / (gpu.bf16_tflops * 1e12 * COMPUTE_EFFICIENCY)
    optimizer = optimizer_shard_gb * OPTIMIZER_PASSES / (gpu.bandwidth_tbs * 1e3 * OPTIMIZER_BANDWIDTH_EFFICIENCY)
    return round(compute + optimizer, 6)


def generator_role(cfg: RunConfig, hf, weights_gb: float) -> dict:
    """A generator GPU: the target's bf16 weights over its tensor-parallel GPUs, and the KV cache (and
    a hybrid's recurrent state) vLLM fills the rest of `generate.memory_utilization` with."""
    text = getattr(hf, "text_config", hf)
    g, gpu = cfg.generate, gpu_of(cfg)
    usable = gpu.memory_gb * (g.memory_utilization or 0.9)
    weights = weights_gb / g.tensor_parallel_size
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_per_token = kinds.count("full_attention") * 2 * text.num_key_value_heads * head_dim * 2
    state = kinds.count("linear_attention") * (
        getattr(text, "linear_num_value_heads", 0)
        * getattr(text, "linear_key_head_dim", 0)
        * getattr(text, "linear_value_head_dim", 0)
        * 2
    )
    per_sequence = (kv_per_token * g.max_model_len + state) / g.tensor_parallel_size / 1e9
    cache = max(0.0, usable - weights)
    return {
        "gpus": g.tensor_parallel_size,
        "memory_gb": {"parameters": round(weights, 2), "kv_cache": round(cache, 2), "total": round(usable, 2)},
        "sequences_at_max_model_len": math.floor(cache / per_sequence) if per_sequence else None,
        "engine_batch": g.batch_size,
        "fits": cache >= per_sequence,
        "note": "vLLM sizes its own cache: the figures are its weights and what is left of "
        "generate.memory_utilization for the cache",
    }


def room_gb(cfg: RunConfig) -> float:
    """What a role's simulated peak may take of the GPU (`plan.memory_headroom`)."""
    return gpu_of(cfg).memory_gb * cfg.plan.memory_headroom


def fitting(cfg: RunConfig, roles: dict[str, dict]) -> None:
    """Mark each role `fits`; refuse the first that does not, naming what would bring it under."""
    gpu, room = gpu_of(cfg), room_gb(cfg)
    for name, role in roles.items():
        if "fits" in role:
            continue
        role["fits"] = role["memory_gb"]["total"] <= room
    for name, role in roles.items():
        if role["fits"]:
            continue
        top = sorted(((v, k) for k, v in role["memory_gb"].items() if k != "total"), reverse=True)[:3]
        parts = ", ".join(f"{k} {v:.1f}" for v, k in top)
        tr = cfg.train
        if name == "generator":
            fields, field = (
                "generate.tensor_parallel_size or a lower generate.max_model_len",
                "generate.tensor_parallel_size",
            )
        elif name == "target":
            fields, field = (
                (
                    f"train.target_gpus above {tr.target_gpus or tr.actor_gpus or 1:g} (its layers spread), "
                    f"a lower tokenize.max_seq_len ({cfg.tokenize.max_seq_len})"
                ),
                "train.target_gpus",
            )
        else:
            fields = (
                f"a lower train.num_anchors ({tr.num_anchors}) or tokenize.max_seq_len "
                f"({cfg.tokenize.max_seq_len}), more train.num_streams ({tr.num_streams}: a smaller "
                "shard), or a smaller drafter (train.num_layers, train.intermediate_size)"
            )
            field = "train.num_anchors"
        raise DFlashError(
            f"the {name} role needs {role['memory_gb']['total']:.1f} GB per GPU at its peak ({parts} GB) "
            f"at the longest sequence ({cfg.tokenize.max_seq_len} tokens), above the "
            f"{cfg.plan.memory_headroom:.0%} of a {gpu.name}'s {gpu.memory_gb:.1f} GB the plan "
            f"allows ({room:.1f} GB); bring it under with {fields}",
            field=field,
        )


def check_memory(cfg: RunConfig, target: str, serving: dict[str, dict] | None = None) -> dict[str, dict]:
    """`train`'s preflight on GPUs: every role's simulated peak at the longest sequence, refused when
    above the GPU's memory (`fitting`); `serving`: the drafters' resolved shapes by name."""
    hf, _ = target_config(cfg, target)
    longest, _ = samples(cfg)
    roles = simulate_roles(cfg, hf, longest, serving=serving)
    fitting(cfg, roles)
    return roles


def straggler_ratios(cfg: RunConfig) -> dict[str, float]:
    """The steps' straggler ratio (mean over an epoch of the longest stream's tokens over the mean's)
    on `plan.dataset` with the run's schedule, without and with length balancing."""
    from dflash_ray.train.schedule import Schedule, dataset_samples, length_group, sample_lengths

    tr = cfg.train
    samples = dataset_samples(cfg.plan.dataset)
    lengths = sample_lengths(samples)
    group = length_group(tr)
    out = {}
    for name, g in (("unbalanced", 0), ("balanced", group)):
        schedule = Schedule(
            samples, tr.num_streams, tr.batch_size, tr.seed, window=tr.shard_window, lengths=lengths, group=g
        )
        out[name] = round(schedule.straggler_ratio(range(schedule.steps_per_epoch)), 3)
    return out
