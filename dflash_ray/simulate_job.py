"""The whole job's time and cost, stage by stage, from the simulated steps (`simulate.py`), the
simulated engines (`simulate_generation.py`) and the run's settings.

Training's step is the slowest of its paths: a drafter's compute and its FSDP2 traffic (all-gathers
and reduce-scatters overlap the compute, so the step waits for the slower of the two, at the bus
bandwidth between the drafters' nodes), and the target's forward plus the features' trip to its
drafter (through page-locked host memory, inside the stream's node), which runs a step ahead with
`train.max_in_flight`. Around the steps: the start (each target GPU reads the weights, every graph
shape compiles once; a restart reuses the compiled artifacts), held-out evaluations, checkpoints
(every drafter rank copies its shard of the fp32 weights and both AdamW moments to host memory and
writes it from a thread; a write outlasting the checkpoint interval holds the next one), and the restarts
expected at `plan.failures_per_gpu_hour` (each a start without compiles and, on average, half a
checkpoint interval redone). Every stage's GPUs are counted held from its start to its end.

No torch, no Ray.
"""

from __future__ import annotations

import math
from typing import Any

COMPILE_S_PER_SHAPE = 16.5  # the H200 check's first compiled step (bench/RESULTS.md, 2026-11-30)
# a shape whose artifacts a restart loads: dynamo traces it again and inductor builds nothing (the CPU
# check's hit against its miss, bench/RESULTS.md; not yet timed on a GPU): a tenth of the compile, assumed
CACHED_COMPILE_S_PER_SHAPE = COMPILE_S_PER_SHAPE / 10
# the H200 check: 157 MB of features device -> page-locked host -> device in 2 x 2.9 ms (2026-11-30)
TRANSFER_GB_PER_S = 0.157 / 0.0058
# tokenization on CPU workers: the seed's 1.87B tokens in 6.5 min on 128 workers
TOKENIZE_TOKENS_PER_S = 1.87e9 / 390
CHECKPOINT_BYTES_PER_PARAMETER = 12  # fp32 weights and AdamW's two fp32 moments

# the field's published training throughput, for comparison (sources in docs/simulated-plan.md)
PUBLISHED = [
    {
        "who": "SpecForge, Qwen3.8-27B DFlash2 recipe, 8 x H200 (FP8 target; 5 capture servers + 3 trainers), "
        "max_len 8,192, ~277 MB of hidden states a sample",
        "gpus": 8,
        "samples_per_s": 10.65,
        "samples_per_s_per_trainer_gpu": 3.7,
    },
    {"who": "SpecForge, the same recipe on 2 x 8 H200", "gpus": 16, "samples_per_s": 17.98},
    {"who": "SpecForge, trainer microbenchmark", "mfu": "43.5-44%"},
]


def significant(x: float) -> float:
    """Four significant digits: a tiny model's step is not zero."""
    return float(f"{x:.4g}")


def bus_bandwidth(cfg) -> float:
    """GB/s between the drafters' nodes: `plan.bus_bandwidth`, else `train.min_bus_bandwidth`; 0: unknown."""
    return cfg.plan.bus_bandwidth or cfg.train.min_bus_bandwidth


def node_bandwidth(cfg, gpu) -> float:
    """GB/s between the GPUs of one node: `plan.node_bus_bandwidth`, else the GPU's NVLink figure."""
    return cfg.plan.node_bus_bandwidth or gpu.nvlink_gb_per_s


def traffic_seconds(cfg, gpu, role: dict) -> dict[str, float]:
    """Seconds each mesh dimension's counted bytes take at its bus: the nodes' where its groups cross
    them, NVLink inside one; 0 where the bus between nodes is unknown (`check_bus` says so)."""
    bus, node = bus_bandwidth(cfg), node_bandwidth(cfg, gpu)
    out = {}
    for dim, t in role.get("traffic", {}).items():
        bw = bus if t["crosses_nodes"] else node
        out[dim] = t["gb"] / bw if bw else 0.0
    return out


def exposed_traffic(traffic_s: float, layer_s: float, units: int) -> float:
    """Traffic the step waits for: each layer's gathers and reductions overlap the compute of the
    layers beside them, but not the frozen head, the loss or AdamW (no layer's traffic lies there),
    and the first gather and the last reduction have no layer to hide behind (a unit's share)."""
    return max(traffic_s / max(1, units), traffic_s - layer_s)


def length_scale(lengths, mean: int, longest: int, at_mean: float, at_longest: float):
    """The target's forward at each of `lengths` over the one at the mean: FLOPs a·L + b·L² (weights
    and linear attention per token; softmax attention per pair) through its simulated figures at the
    mean and longest sequences."""
    import numpy as np

    L = np.minimum(np.asarray(lengths, dtype=float), longest)
    if longest <= mean or at_longest <= at_mean:
        return L / mean
    b = max(0.0, (at_longest / longest - at_mean / mean) / (longest - mean))
    a = at_mean / mean - b * mean
    return (a * L + b * L * L) / at_mean


def training_step(cfg, at_mean: dict[str, dict], stragglers: dict | None, gpu, scale=None) -> dict[str, Any]:
    """A stream's step, by path: the drafter's compute plus the traffic it cannot hide, and the
    target's forward (with the features' trip) beside it, or before it on a colocated GPU. `scale`:
    the target's time at the workload's lengths over its time at the mean (`length_scale`): with
    length grouping a step's streams are all long or all short together, and the target's time
    grows with length where the drafter's (anchors x block) barely does, so the step is the mean of
    the slower path over the lengths, not the slower path at the mean length."""
    import numpy as np

    tr = cfg.train
    drafters = {k: r for k, r in at_mean.items() if k.startswith("drafter") or k == "stream"}
    role = max(drafters.values(), key=lambda r: r["step_seconds"])
    by_dim = traffic_seconds(cfg, gpu, role)
    traffic_s = sum(by_dim.values())
    target_alone = role.get("target_seconds", 0.0)  # a colocated stream's forward, inside its step_seconds
    compute = role["step_seconds"] - target_alone
    exposed = exposed_traffic(traffic_s, role.get("layer_seconds", 0.0), role.get("fsdp_units", 1))
    drafter = compute + exposed
    scale = np.ones(1) if scale is None else np.asarray(scale, dtype=float)
    straggle = stragglers["balanced"] if stragglers else 1.0
    out: dict[str, Any] = {
        "drafter_compute_s": significant(compute),
        "drafter_layer_compute_s": significant(role.get("layer_seconds", 0.0)),
        "traffic_gb": {d: t["gb"] for d, t in role.get("traffic", {}).items()},
        "traffic_s": {d: significant(v) for d, v in by_dim.items()},
        "traffic_exposed_s": significant(exposed),
        "fsdp2_gb": role.get("collective_gb_per_step", 0.0),
        "fsdp2_s": significant(traffic_s),
        "bus_gb_per_s": bus_bandwidth(cfg) or None,
        "node_bus_gb_per_s": node_bandwidth(cfg, gpu),
    }
    if tr.colocate:
        target_s = target_alone * straggle * scale
        steps = drafter + target_s
        paths = {"drafter compute": compute, "traffic not hidden": exposed, "target forward": float(target_s.mean())}
        at_mean_s = drafter + target_alone * straggle
        out["target_s"] = significant(target_alone)
    else:
        target = at_mean["target"]["step_seconds"] * straggle
        sent = max(r["memory_gb"].get("inputs", 0.0) for r in drafters.values())  # what a batch carries
        transfer = sent / TRANSFER_GB_PER_S
        feed = (target + transfer) * scale
        steps = np.maximum(drafter, feed) if tr.max_in_flight else drafter + feed
        paths = {"drafter compute": compute, "traffic not hidden": exposed, "target and transfer": float(feed.mean())}
        at_mean_s = max(drafter, target + transfer) if tr.max_in_flight else drafter + target + transfer
        out |= {"target_s": significant(target), "features_gb": sent, "transfer_s": significant(transfer)}
    step = float(steps.mean())
    out["step_s_at_mean_length"] = significant(at_mean_s)
    out["step_s"] = significant(step)
    out["traffic_exposed_share"] = round(exposed / step, 3) if step else 0.0
    out["bound"] = max(paths, key=lambda k: paths[k])
    return out


def plan_training(
    cfg,
    step: dict[str, Any],
    sample,
    per_stream: int,
    target_weights_bytes: float,
    drafter_parameters: int,
    eval_step_s: float,
) -> dict[str, Any]:
    """The training stage: `train.num_streams` streams of `per_stream` GPUs each."""
    tr, p = cfg.train, cfg.plan
    streams = tr.num_streams
    gpus = streams * per_stream
    step_s = step["step_s"]
    samples_per_step = streams * tr.batch_size
    steps = math.ceil(p.train_tokens * p.epochs / (sample.seq_len * samples_per_step))
    compute_s = steps * step_s
    # a node's copy of the target from storage (ranged reads, once a node, the nodes at once), then
    # each GPU's share of it from the local disk; the drafters read their few tensors meanwhile
    fetch_s = target_weights_bytes / 1e9 / p.storage_gb_per_s
    load_s = target_weights_bytes / max(1.0, float(tr.target_gpus or tr.actor_gpus or 1)) / 1e9 / p.load_gb_per_s
    shapes = math.ceil(cfg.tokenize.max_seq_len / tr.length_bucket) * (2 if tr.eval_every and tr.heldout else 1)
    compile_s = shapes * COMPILE_S_PER_SHAPE
    evals = steps // tr.eval_every + 1 if tr.eval_every and tr.heldout else 0
    one_eval_s = math.ceil(tr.heldout / samples_per_step) * eval_step_s
    eval_s = evals * one_eval_s
    interval_s = tr.checkpoint_every * step_s
    checkpoints = steps // tr.checkpoint_every
    if tr.checkpoint_every_minutes:
        checkpoints = max(checkpoints, int(compute_s / 60 / tr.checkpoint_every_minutes))
        interval_s = min(interval_s, tr.checkpoint_every_minutes * 60)
    # the step waits for its shard's copy to host memory; a thread writes it (train/checkpoint_files.py), and the
    # next checkpoint waits for that write when it outlasts the interval
    shard = drafter_parameters * CHECKPOINT_BYTES_PER_PARAMETER / tr.num_streams / 1e9
    checkpoint_s = shard / TRANSFER_GB_PER_S + max(0.0, shard / p.checkpoint_gb_per_s - interval_s)
    base_s = fetch_s + load_s + compile_s + compute_s + eval_s + checkpoints * checkpoint_s
    failures = p.failures_per_gpu_hour * gpus * base_s / 3600
    # a restart: the lost node's replacement fetches the target again (the others keep their copy),
    # every GPU loads it, the warm-up loads the saved artifacts, and half a checkpoint interval is redone
    restart_each_s = fetch_s + load_s + shapes * CACHED_COMPILE_S_PER_SHAPE + interval_s / 2
    restart_s = failures * restart_each_s
    wall_s = base_s + restart_s
    return {
        "gpus": gpus,
        "streams": streams,
        "steps": steps,
        "step": step,
        "samples_per_s": round(samples_per_step / step_s, 2),
        "samples_per_s_per_gpu": round(samples_per_step / step_s / gpus, 3),
        "tokens_per_s_per_gpu": round(samples_per_step * sample.seq_len / step_s / gpus, 1),
        "seconds": {
            "weights_fetch": round(fetch_s, 1),
            "weights_load": round(load_s, 1),
            "compile": round(compile_s, 1),
            "steps": round(compute_s, 1),
            "evaluations": round(eval_s, 1),
            "checkpoints": round(checkpoints * checkpoint_s, 1),
            "restarts": round(restart_s, 1),
        },
        "compiled_shapes": shapes,
        "evaluations": evals,
        "evaluation_share": round(eval_s / compute_s, 4) if compute_s else 0.0,
        # the least eval_every that keeps the held-out evaluations within 3% of the steps' time
        "eval_every_for_3_percent": math.ceil(one_eval_s / (0.03 * step_s)) if one_eval_s else None,
        "checkpoints": checkpoints,
        "checkpoint_gb": round(drafter_parameters * CHECKPOINT_BYTES_PER_PARAMETER / 1e9, 1),
        "checkpoint_write_s": round(shard / p.checkpoint_gb_per_s, 1),  # a rank's shard, in the background
        "expected_restarts": round(failures, 3),
        "cold_start_s": round(fetch_s + load_s + compile_s, 1),
        "restart_s": round(restart_each_s, 1),  # each: fetch, load, the cached warm-up, half an interval redone
        "wall_hours": round(wall_s / 3600, 2),
        "gpu_hours": round(wall_s * gpus / 3600, 1),
    }


def plan_stages(
    cfg, generation: dict, training: dict, decode_step_s: float, target_weights_bytes: float, drafter_parameters: int
) -> dict[str, dict]:
    """Every stage's wall hours and GPU-hours, in the pipeline's order."""
    p, e = cfg.plan, cfg.evaluate
    tokens = generation["output_tokens"] + generation["lengths"]["prompt_mean"] * generation["lengths"]["sequences"]
    tokenize_s = tokens / TOKENIZE_TOKENS_PER_S
    evaluate_s = target_weights_bytes / 1e9 / p.load_gb_per_s + e.num_prompts * e.max_new_tokens * decode_step_s
    export_s = drafter_parameters * (CHECKPOINT_BYTES_PER_PARAMETER + 2) / 1e9 / p.checkpoint_gb_per_s
    stages = {
        "generation": {"wall_hours": generation["wall_hours"], "gpu_hours": generation["gpu_hours"]},
        "tokenization": {
            "wall_hours": round(tokenize_s / 3600, 2),
            "gpu_hours": 0.0,
            "note": "CPU workers at the seed's rate (1.87B tokens in 6.5 min on 128)",
        },
        "training": {"wall_hours": training["wall_hours"], "gpu_hours": training["gpu_hours"]},
        "evaluation": {
            "wall_hours": round(evaluate_s / 3600, 2),
            "gpu_hours": round(evaluate_s / 3600, 2),
            "note": f"one GPU: {e.num_prompts} prompts x {e.max_new_tokens} tokens at the target's batch-1 decode step",
        },
        "export": {
            "wall_hours": round(export_s / 3600, 3),
            "gpu_hours": 0.0,
            "note": "CPU: the checkpoint read, bf16 written",
        },
    }
    if p.dollars_per_gpu_hour:
        for stage in stages.values():
            stage["dollars"] = round(stage["gpu_hours"] * p.dollars_per_gpu_hour)
    return stages


def job_total(cfg, stages: dict[str, dict]) -> dict[str, Any]:
    total = {
        "wall_hours": round(sum(s["wall_hours"] for s in stages.values()), 2),
        "gpu_hours": round(sum(s["gpu_hours"] for s in stages.values()), 1),
    }
    if cfg.plan.dollars_per_gpu_hour:
        total["dollars"] = round(total["gpu_hours"] * cfg.plan.dollars_per_gpu_hour)
        total["dollars_per_gpu_hour"] = cfg.plan.dollars_per_gpu_hour
    return total


def check_bus(cfg, at_mean: dict[str, dict], step: dict[str, Any]) -> list[str]:
    """Warnings on the bus: unknown where the drafters' traffic crosses nodes, and traffic the step
    waits for (more than a fifth of it)."""
    out = []
    for name, role in at_mean.items():
        crossing = sum(t["gb"] for t in role.get("traffic", {}).values() if t["crosses_nodes"])
        if crossing and not bus_bandwidth(cfg):
            out.append(
                f"the {name} role's traffic across nodes ({crossing:.3g} GB a step) is not priced: no bus "
                "bandwidth is known (set plan.bus_bandwidth to `dflash-ray netcheck`'s figure, or "
                "train.min_bus_bandwidth)"
            )
    if step.get("traffic_exposed_share", 0) > 0.2:
        out.append(
            f"the step waits {step['traffic_exposed_s']:.3g} s for the drafters' traffic "
            f"({step['traffic_exposed_share']:.0%} of it; {step['fsdp2_gb']} GB a rank a step): a layout that "
            "keeps it inside a node (train.layout=hsdp) or a faster bus would hide it"
        )
    return out
