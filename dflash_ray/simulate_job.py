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


def _sig(x: float) -> float:
    """Four significant digits: a tiny model's step is not zero."""
    return float(f"{x:.4g}")


def bus_bandwidth(cfg) -> float:
    """GB/s between the drafters' nodes: `plan.bus_bandwidth`, else `train.min_bus_bandwidth`; 0: unknown."""
    return cfg.plan.bus_bandwidth or cfg.train.min_bus_bandwidth


def training_step(cfg, at_mean: dict[str, dict], stragglers: dict | None) -> dict[str, Any]:
    """A stream's step at the workload's mean length, by path."""
    tr = cfg.train
    bus = bus_bandwidth(cfg)
    drafters = {k: r for k, r in at_mean.items() if k.startswith("drafter") or k == "stream"}
    compute = max(r["step_seconds"] for r in drafters.values())
    traffic = max(r.get("collective_gb_per_step", 0.0) for r in drafters.values())
    collective = traffic / bus if bus else 0.0
    drafter = max(compute, collective)
    out: dict[str, Any] = {
        "drafter_compute_s": _sig(compute),
        "fsdp2_gb": traffic,
        "fsdp2_s": _sig(collective),
        "bus_gb_per_s": bus or None,
    }
    paths = {"drafter compute": compute, "FSDP2 traffic": collective}
    if tr.colocate:
        step = drafter
    else:
        target = at_mean["target"]["step_seconds"] * (stragglers["balanced"] if stragglers else 1.0)
        sent = max(r["memory_gb"].get("inputs", 0.0) for r in drafters.values())  # what a batch carries
        transfer = sent / TRANSFER_GB_PER_S
        paths["target and transfer"] = target + transfer
        step = max(drafter, target + transfer) if tr.max_in_flight else drafter + target + transfer
        out |= {"target_s": _sig(target), "features_gb": sent, "transfer_s": _sig(transfer)}
    out["step_s"] = _sig(step)
    out["bound"] = max(paths, key=lambda k: paths[k])
    return out


def plan_training(
    cfg,
    step: dict[str, Any],
    sample,
    gpus: int,
    per_stream: int,
    target_weights_bytes: float,
    drafter_parameters: int,
    eval_step_s: float,
) -> dict[str, Any]:
    """The training stage on `gpus` GPUs (`gpus // per_stream` streams)."""
    tr, p = cfg.train, cfg.plan
    streams = max(1, gpus // per_stream)
    step_s = step["step_s"]
    samples_per_step = streams * tr.batch_size
    steps = math.ceil(p.train_tokens * p.epochs / (sample.seq_len * samples_per_step))
    compute_s = steps * step_s
    load_s = target_weights_bytes / max(1.0, float(tr.target_gpus or tr.actor_gpus or 1)) / 1e9 / p.load_gb_per_s
    shapes = math.ceil(cfg.tokenize.max_seq_len / tr.length_bucket) * (2 if tr.eval_every and tr.heldout else 1)
    compile_s = shapes * COMPILE_S_PER_SHAPE
    evals = steps // tr.eval_every + 1 if tr.eval_every and tr.heldout else 0
    eval_s = evals * math.ceil(tr.heldout / samples_per_step) * eval_step_s
    interval_s = tr.checkpoint_every * step_s
    checkpoints = steps // tr.checkpoint_every
    if tr.checkpoint_every_minutes:
        checkpoints = max(checkpoints, int(compute_s / 60 / tr.checkpoint_every_minutes))
        interval_s = min(interval_s, tr.checkpoint_every_minutes * 60)
    # the step waits for its shard's copy to host memory; a thread writes it (train/checkpoint_files.py), and the
    # next checkpoint waits for that write when it outlasts the interval
    shard = drafter_parameters * CHECKPOINT_BYTES_PER_PARAMETER / tr.num_streams / 1e9
    checkpoint_s = shard / TRANSFER_GB_PER_S + max(0.0, shard / p.checkpoint_gb_per_s - interval_s)
    base_s = load_s + compile_s + compute_s + eval_s + checkpoints * checkpoint_s
    failures = p.failures_per_gpu_hour * gpus * base_s / 3600
    restart_s = failures * (load_s + interval_s / 2)
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
            "weights_load": round(load_s, 1),
            "compile": round(compile_s, 1),
            "steps": round(compute_s, 1),
            "evaluations": round(eval_s, 1),
            "checkpoints": round(checkpoints * checkpoint_s, 1),
            "restarts": round(restart_s, 1),
        },
        "compiled_shapes": shapes,
        "evaluations": evals,
        "checkpoints": checkpoints,
        "checkpoint_gb": round(drafter_parameters * CHECKPOINT_BYTES_PER_PARAMETER / 1e9, 1),
        "checkpoint_write_s": round(shard / p.checkpoint_gb_per_s, 1),  # a rank's shard, in the background
        "expected_restarts": round(failures, 3),
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


def check_bus(cfg, at_mean: dict[str, dict]) -> list[str]:
    """Warnings on the bus: unknown when the drafters shard, slower than their compute when known."""
    tr = cfg.train
    bus = bus_bandwidth(cfg)
    out = []
    for name, role in at_mean.items():
        traffic = role.get("collective_gb_per_step")
        if not traffic:
            continue
        if not bus:
            out.append(
                f"the {name} role's FSDP2 traffic ({traffic} GB a step) is not priced: no bus bandwidth is "
                "known (set plan.bus_bandwidth to `dflash-ray netcheck`'s figure, or train.min_bus_bandwidth)"
            )
        elif traffic / bus > role["step_seconds"]:
            source = (
                f"plan.bus_bandwidth={bus:g}"
                if cfg.plan.bus_bandwidth
                else f"train.min_bus_bandwidth={tr.min_bus_bandwidth:g}"
            )
            out.append(
                f"the {name} role's FSDP2 traffic ({traffic} GB a step) takes {traffic / bus:.2f} s at "
                f"{source} GB/s, more than its {role['step_seconds']:.2f} s of compute: the step waits for "
                f"it (priced so); it hides behind the compute from {traffic / role['step_seconds']:.0f} GB/s"
            )
    return out
