"""`dflash-ray plan`: will the run fit, how fast will it go and what will it cost, from the run's own
config and code.

Each GPU role (the target; each drafter of `train.drafters`; or the colocated pair) runs its real step
code once under fake tensors (`dflash_ray.simulate`) at the longest sequence the config allows: peak
memory by category against the GPU of the training nodes (`plan.gpu`), FLOPs counted. A role that
does not fit is refused here and by `train`'s preflight, naming the fields that would bring it
under. The same steps at the workload's mean length give the step time (counted FLOPs at the
utilisation calibrated on the H200 measurement), and with FSDP2's traffic at the bus, the features'
trip, start-up, evaluations, checkpoints and restarts, the training stage's time
(`dflash_ray.simulate_job`) for the workload (the seed's by default: 902K prompts, 1.64B output
tokens, 6 epochs). Generation is simulated from generate's settings and the target's config
(`dflash_ray.simulate_generation`). Every stage's wall time and GPU-hours, and dollars at
`plan.dollars_per_gpu_hour`, sum to the job's. A figure that comes out no number (inf, nan) is
refused, naming the settings it is figured from, never printed as a null wall time.
"""

from __future__ import annotations

import argparse
import functools
import math
from typing import Any


from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError
from dflash_ray.planning import (
    ESTIMATOR,
    cluster_gpus,
    fallback_warning,
    fitting,
    generator_role,
    gpu_of,
    samples,
    straggler_ratios,
    stream_gpus,
    target_config,
    target_summary,
    team_drafters,
)
from dflash_ray.layout_choice import choose, degraded
from dflash_ray.stages import Stage


def check_sample_length(cfg: RunConfig, hf) -> None:
    """Refuse a workload whose mean sample (plan.train_tokens over plan.prompts) is longer than the
    target's context: no such sample is generated or trained, and the steps simulated at that length
    would take hours (the attention's pairs are counted position by position)."""
    p = cfg.plan
    context = getattr(getattr(hf, "text_config", None) or hf, "max_position_embeddings", None)
    per_sample = p.train_tokens / p.prompts
    if isinstance(context, int) and per_sample > context:
        raise DFlashError(
            f"plan.train_tokens={p.train_tokens:g} over plan.prompts={p.prompts:g} is {per_sample:.3g} tokens a "
            f"sample, longer than the target's context (max_position_embeddings={context}): allowed: at most "
            f"{context} tokens a sample",
            field="plan.train_tokens",
        )


def _length_scale(cfg: RunConfig, lengths, longest, mean, draws: int = 20_000):
    """The target's time at each of a draw of the workload's trained lengths over its time at the
    mean (`simulate_job.length_scale`), from a layout's simulated roles at the mean and longest."""
    import numpy as np

    from dflash_ray import simulate_job

    rng = np.random.default_rng(cfg.seed)
    picked = rng.integers(0, lengths.prompt.size, min(draws, lengths.prompt.size))
    tokens = np.minimum(lengths.prompt[picked] + lengths.response[picked], cfg.tokenize.max_seq_len)

    def target_flops(roles: dict) -> float:
        return roles["stream"]["target_flops"] if "stream" in roles else roles["target"]["flops_per_step"]

    def scale(peak: dict, at_mean: dict):
        return simulate_job.length_scale(
            tokens, mean.seq_len, longest.seq_len, target_flops(at_mean), target_flops(peak)
        )

    return scale


def _training_warnings(cfg: RunConfig, training: dict, per_stream: int, train_gpus: int) -> list[str]:
    """More GPUs than the nodes hold, and evaluations that cost more than 3% of the steps."""
    out = []
    if training["gpus"] > train_gpus:
        out.append(
            f"{cfg.train.num_streams} streams of {per_stream} GPU(s) need {training['gpus']} GPUs; the training "
            f"nodes have {train_gpus} (plan.training_gpus or the cluster's train_node GPUs)"
        )
    if training["evaluation_share"] > 0.03:
        out.append(
            f"held-out evaluations take {training['evaluation_share']:.1%} of training's steps; "
            f"train.eval_every={training['eval_every_for_3_percent']} keeps them within 3%"
        )
    return out


def _roles_at_both(peak: dict[str, dict], at_mean: dict[str, dict]) -> dict[str, dict]:
    """Each role at the longest sample (memory), with its step and FLOPs at the mean one beside."""
    return {
        name: {
            **role,
            "step_seconds_at_mean": at_mean.get(name, {}).get("step_seconds"),
            "flops_per_step_at_mean": at_mean.get(name, {}).get("flops_per_step"),
        }
        for name, role in peak.items()
    }


def run_plan(cfg: RunConfig, target: str = "") -> dict[str, Any]:
    from dflash_ray import simulate_generation, simulate_job
    from dflash_ray.preflight import preflight
    from dflash_ray.train.drafters import union_layers

    warnings = preflight(cfg)  # every check a run of this config makes before it starts
    p, gpu = cfg.plan, gpu_of(cfg)
    gen_gpus, train_gpus = cluster_gpus(p.cluster) if p.cluster else (p.generation_gpus, p.training_gpus)
    if gen_gpus < 1 or train_gpus < 1:
        raise DFlashError("needs at least one GPU for each stage", field="plan.generation_gpus")
    hf, source = target_config(cfg, target)
    check_sample_length(cfg, hf)
    warnings += fallback_warning(cfg, target)
    # the dataset read before any simulation; a completions one gives lengths, not steps
    tokenized = bool(p.dataset) and simulate_generation.dataset_kind(p.dataset) == "tokenized"
    stragglers = straggler_ratios(cfg) if tokenized else None
    longest, mean = samples(cfg)
    generation_lengths = simulate_generation.workload_lengths(cfg)
    scale = _length_scale(cfg, generation_lengths, longest, mean)
    layout = choose(cfg, hf, longest, mean, stragglers, scale)
    chosen = layout.pop("chosen_candidate")  # the config's own layout, simulated and priced
    peak, at_mean, step = dict(chosen["_peak"]), chosen["_at_mean"], dict(chosen["_step"])
    peak["generator"] = generator_role(cfg, hf, (peak.get("target") or peak["stream"])["weights_gb"])
    fitting(cfg, peak)

    per_stream = stream_gpus(cfg)
    if p.training_tokens_per_s_per_gpu > 0:
        step |= {"step_s": mean.seq_len * mean.batch / (p.training_tokens_per_s_per_gpu * per_stream)}
        step["bound"] = "measured (plan.training_tokens_per_s_per_gpu)"
    warnings += simulate_job.check_bus(cfg, at_mean, step)
    warnings += [f"a better layout for these GPUs: {layout['better']}"] if "better" in layout else []
    weights = (peak.get("target") or peak["stream"])["weights_gb"] * 1e9
    drafter_parameters = sum(r["parameters"] for k, r in at_mean.items() if "parameters" in r)
    generation = simulate_generation.plan_generation(cfg, hf, weights, gen_gpus, gpu, generation_lengths)
    # an evaluation batch: the target's forward, and a third of the drafter's compute or a quarter of its traffic
    eval_step_s = step.get("target_s", 0.0) + max(step["drafter_compute_s"] / 3, step["fsdp2_s"] / 4)
    training = simulate_job.plan_training(cfg, step, mean, per_stream, weights, drafter_parameters, eval_step_s)
    warnings += _training_warnings(cfg, training, per_stream, train_gpus)
    # a GPU or a node lost mid-run: priced as the calm step, at the calm step's rate where that is measured
    lost = degraded(cfg, hf, chosen["_sharding"], longest, mean, stragglers, scale, chosen["_step"], step["step_s"])
    training |= {
        "gpus_per_stream": per_stream,
        "layout": layout,
        "degraded": lost,
        "straggler_ratio": stragglers or "no tokenized plan.dataset: the step assumes streams of equal lengths",
        "rate_source": step["bound"]
        if step["bound"].startswith("measured")
        else f"simulated step over the workload's lengths (mean {mean.seq_len} tokens): {step['step_s']:.3g} s "
        f"on {per_stream} GPU(s), bound by {step['bound']}",
    }
    stages = simulate_job.plan_stages(
        cfg, generation, training, generation["engine"]["decode_step_s_at_batch_1"], weights, drafter_parameters
    )
    features = len(union_layers([list(d.target_layer_ids) for _, _, d in team_drafters(cfg, hf)])[0])
    hidden = (getattr(hf, "text_config", None) or hf).hidden_size
    offline = p.train_tokens * features * hidden * 2  # bf16 features of every token
    roles = _roles_at_both(peak, at_mean)
    summary = {
        "stage": "plan",
        "cluster": p.cluster or None,
        "target_config": source,
        "target": target_summary(hf, (peak.get("target") or peak["stream"])["weights_gb"]),
        "gpu": {
            "name": gpu.name,
            "memory_gb": gpu.memory_gb,
            "usable_gb": round(gpu.memory_gb * p.memory_headroom, 1),
            "bf16_tflops": gpu.bf16_tflops,
            "bandwidth_tbs": gpu.bandwidth_tbs,
        },
        "estimator": ESTIMATOR,
        "shapes": {"longest": vars(longest), "mean": vars(mean)},
        "roles": roles,
        "workload": {
            "prompts": p.prompts,
            "output_tokens": p.output_tokens,
            "train_tokens": p.train_tokens,
            "epochs": p.epochs,
        },
        "generation": generation,
        "training": training,
        "stages": stages,
        "job": simulate_job.job_total(cfg, stages),
        "throughput": {
            "samples_per_s": training["samples_per_s"],
            "samples_per_s_per_gpu": training["samples_per_s_per_gpu"],
            "samples_per_s_per_drafter_gpu": round(training["samples_per_s"] / training["streams"], 2),
            "mean_sample_tokens": mean.seq_len,
            "features_mb_per_sample": round(step.get("features_gb", 0.0) * 1e3 / max(1, mean.batch)),
            "published": simulate_job.PUBLISHED,
        },
        "offline_storage_avoided_tb": round(offline / 1e12, 1),
        "offline_storage_note": f"captured layers ({features}) x hidden {hidden} x 2 bytes per token, "
        "written once and read every epoch",
        "warnings": warnings,
    }
    return finite(cfg, summary)


# the settings each part of a plan is figured from: named when one of its figures is no number
FIGURED_FROM = {
    "generation": (
        "plan.generation_tokens_per_s_per_gpu",
        "plan.generation_roofline_share",
        "plan.response_mean_tokens",
        "plan.output_tokens",
        "plan.prompts",
        "plan.generation_gpus",
        "plan.load_gb_per_s",
        "plan.engine_start_s",
    ),
    "training": (
        "plan.training_tokens_per_s_per_gpu",
        "plan.train_tokens",
        "plan.epochs",
        "plan.training_gpus",
        "plan.bus_bandwidth",
        "plan.node_bus_bandwidth",
        "train.min_bus_bandwidth",
        "plan.storage_gb_per_s",
        "plan.load_gb_per_s",
        "plan.checkpoint_gb_per_s",
        "plan.failures_per_gpu_hour",
    ),
}


def _non_finite(value: Any, path: str) -> Any:
    """(path, value) of every float in `value` that is inf or nan, depth first."""
    if isinstance(value, float) and not math.isfinite(value):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _non_finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _non_finite(v, f"{path}[{i}]")


def finite(cfg: RunConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """`summary`, once every figure in it is a number: a plan with an inf or nan (`--json` would print
    null, a wall time of nothing) is refused naming the figure and the settings its part of the plan
    is figured from; of those, the ones given away from their defaults (which plan finite figures)."""
    found = next(_non_finite(summary, ""), None)
    if found is None:
        return summary
    path, value = found
    part = next((p for p in path.replace("[", ".").split(".") if p in FIGURED_FROM), None)
    names = FIGURED_FROM[part] if part else tuple(dict.fromkeys(n for ns in FIGURED_FROM.values() for n in ns))
    default = RunConfig()

    def setting(config: RunConfig, name: str) -> Any:
        return functools.reduce(getattr, name.split("."), config)

    given = [n for n in names if setting(cfg, n) != setting(default, n)]
    named = ", ".join(f"{n}={setting(cfg, n)!r}" for n in (given or names))
    raise DFlashError(
        f"the plan's {path} comes out {value}, no number: it is figured from {named}; bring "
        f"{'them' if len(given or names) > 1 else 'it'} to a rate a real cluster has",
        field=given[0] if given else None,
    )


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    import dataclasses

    if args.cluster:
        cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, cluster=args.cluster))
    return run_plan(cfg)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="YAML", help="cluster launcher config to count GPUs in (plan.cluster)")


STAGES = (
    Stage(
        name="plan",
        help="projected GPU-hours and wall time of a workload",
        command=_command,
        arguments=_arguments,
        section="plan",
        order=92,
    ),
)
