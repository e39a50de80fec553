"""The layout a run's drafters take, chosen by the plan: for the run's GPUs, every way of holding
the drafter (`train/mesh.py`: fsdp, hsdp, replicate), with each stream's target and drafter on
GPUs of their own or colocated on one, is simulated from the real step code (memory at the longest
sequence, FLOPs and counted collective bytes at the mean) and priced by `simulate_job.training_step`
at the buses it would use. The layout that fits and trains the most samples a GPU a second wins;
`train.layout: auto` takes its sharding (`choose`), and the plan names a colocation or stream count
that would beat the config's. No Ray.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_ray import simulate_job
from dflash_ray.planning import Sharding, gpu_of, room_gb, sharding_of, simulate_roles, stream_gpus
from dflash_ray.train.mesh import KINDS, balanced_count


def _fits(cfg, roles: dict[str, dict]) -> bool:
    return all(r["memory_gb"]["total"] <= room_gb(cfg) for r in roles.values())


def _variant(cfg, colocate: bool, gpus: int):
    """`cfg` with its streams colocated or not, as many as `gpus` hold."""
    tr = dataclasses.replace(cfg.train, colocate=colocate)
    probe = dataclasses.replace(cfg, train=tr)
    streams = max(1, gpus // stream_gpus(probe))
    return dataclasses.replace(cfg, train=dataclasses.replace(tr, num_streams=streams))


def price(cfg, hf, sharding: Sharding, longest, mean, stragglers, scale) -> dict[str, Any]:
    """One layout: whether it fits at the longest sequence (the layers kept gathered only where they
    fit), its step and throughput at the workload's lengths; its simulated roles and step kept
    (`_`-keys) for the plan to go on with."""
    peak = simulate_roles(cfg, hf, longest, sharding=sharding)
    if not _fits(cfg, peak) and sharding.keep_gathered:
        sharding = dataclasses.replace(sharding, keep_gathered=False)
        peak = simulate_roles(cfg, hf, longest, sharding=sharding)
    at_mean = simulate_roles(cfg, hf, mean, sharding=sharding)
    step = simulate_job.training_step(cfg, at_mean, stragglers, gpu_of(cfg), scale(peak, at_mean))
    tr = cfg.train
    gpus = tr.num_streams * stream_gpus(cfg)
    replicas, shard = sharding.shape(tr.num_streams)
    return {
        "layout": sharding.kind,
        "colocate": tr.colocate,
        "streams": tr.num_streams,
        "gpus": gpus,
        "mesh": {"replicas": replicas, "shard": shard},
        "keep_gathered": sharding.keep_gathered,
        "reduce_dtype": "bfloat16" if sharding.reduce_bf16 else "float32",
        "fits": _fits(cfg, peak),
        "peak_gb": max(r["memory_gb"]["total"] for r in peak.values()),
        "step_s": step["step_s"],
        "bound": step["bound"],
        "traffic_gb": step["traffic_gb"],
        "traffic_exposed_share": step["traffic_exposed_share"],
        "samples_per_s_per_gpu": round(tr.num_streams * tr.batch_size / step["step_s"] / gpus, 3),
        "_sharding": sharding,
        "_peak": peak,
        "_at_mean": at_mean,
        "_step": step,
    }


def _settings(c: dict) -> str:
    return (
        f"train.colocate={str(c['colocate']).lower()} train.num_streams={c['streams']} train.layout={c['layout']}"
        + ("" if c["keep_gathered"] else " train.keep_gathered=false")
    )


def _reason(best: dict, others: list[dict], cfg) -> str:
    bus = simulate_job.bus_bandwidth(cfg)
    shape = best["mesh"]
    where = {
        "fsdp": f"sharded over all {shape['shard']} drafter ranks",
        "hsdp": f"sharded over the {shape['shard']} drafter ranks of a node and replicated across "
        f"{shape['replicas']} node(s)",
        "replicate": f"whole on each of the {shape['replicas']} drafter ranks",
    }[best["layout"]]
    parts = [
        f"{best['layout']}: the drafter {where}; {best['samples_per_s_per_gpu']} samples/s a GPU, the step "
        f"{best['step_s']:.3g} s bound by {best['bound']}, {best['traffic_exposed_share']:.0%} of it traffic not "
        f"hidden (bus between nodes {bus or 'unknown'} GB/s)"
    ]
    for c in others:
        why = (
            "does not fit" if not c["fits"] else f"{c['samples_per_s_per_gpu']} samples/s a GPU, bound by {c['bound']}"
        )
        parts.append(f"{c['layout']}: {why}")
    return "; ".join(parts)


def choose(cfg, hf, longest, mean, stragglers, scale) -> dict[str, Any]:
    """With `train.layout: auto`, every layout priced at the run's GPUs: the sharding the run takes
    (the best that fits with its colocation), why, and the best of all; a layout the config sets is
    priced alone. `chosen_candidate` holds the choice whole (its simulated roles and step)."""
    gpus = cfg.train.num_streams * stream_gpus(cfg)
    if cfg.train.layout != "auto":
        alone = price(cfg, hf, sharding_of(cfg), longest, mean, stragglers, scale)
        return {
            **{k: alone[k] for k in ("keep_gathered", "reduce_dtype", "mesh")},
            "chosen": alone["layout"],
            "reason": f"train.layout={cfg.train.layout}, as the config sets it (auto: the plan compares them all)",
            "candidates": [{k: v for k, v in alone.items() if not k.startswith("_")}],
            "chosen_candidate": alone,
        }
    colocations = [cfg.train.colocate]
    if not cfg.train.drafters and (cfg.train.target_gpus or 1) <= 1:
        colocations.append(not cfg.train.colocate)
    table = []
    for colocate in colocations:
        variant = cfg if colocate == cfg.train.colocate else _variant(cfg, colocate, gpus)
        for kind in KINDS:
            if variant.train.num_streams == 1 and kind != "fsdp":
                continue  # one rank: nothing to shard or replicate
            table.append(price(variant, hf, sharding_of(variant, kind), longest, mean, stragglers, scale))
    own = [c for c in table if c["colocate"] == cfg.train.colocate]
    fitting = [c for c in own if c["fits"]]
    if fitting:
        chosen = max(fitting, key=lambda c: c["samples_per_s_per_gpu"])
        reason = _reason(chosen, [c for c in own if c is not chosen], cfg)
    else:  # the plan's memory check (`planning.fitting`) refuses it, naming what would bring it under
        chosen = min(own, key=lambda c: c["peak_gb"])
        reason = "no layout fits the GPU at the longest sequence; the one nearest to fitting"
    best = max((c for c in table if c["fits"]), key=lambda c: c["samples_per_s_per_gpu"], default=chosen)
    public = [{k: v for k, v in c.items() if not k.startswith("_")} for c in table]
    out: dict[str, Any] = {
        "chosen": chosen["layout"],
        "keep_gathered": chosen["keep_gathered"],
        "reduce_dtype": chosen["reduce_dtype"],
        "mesh": chosen["mesh"],
        "reason": reason,
        "candidates": public,
        "chosen_candidate": chosen,
    }
    if best is not chosen and best["samples_per_s_per_gpu"] > chosen["samples_per_s_per_gpu"] * 1.02:
        out["better"] = (
            f"{_settings(best)} trains {best['samples_per_s_per_gpu']} samples/s a GPU on the same {gpus} GPUs "
            f"against this config's {chosen['samples_per_s_per_gpu']}"
        )
    return out


def degraded(
    cfg, hf, sharding: Sharding, longest, mean, stragglers, scale, calm: dict, calm_s: float
) -> dict[str, Any]:
    """The step of a run of `cfg` that lost one GPU, and one that lost one node, priced as the calm
    step `calm` is, on the mesh the run builds from the placed ranks (`mesh.balanced`: hsdp's rows
    one size; the placed ranks left over idle). Under `train.lost_streams=shrink` each training rank
    takes one batch a step (one pass, a smaller global batch); under `stand_in` the training ranks
    take the lost streams' batches too (`schedule.slots`: the global batch kept, `schedule.passes`
    passes a step, each gathering and reduce-scattering in its row, the all-reduce across the rows
    once a step: `gradients.accumulated`). A loss below `train.min_streams` (unset: all of them)
    stops the run until the GPUs return. `calm_s`: the calm step the plan goes by (measured where
    `plan.training_tokens_per_s_per_gpu` is set), which the degraded ones are scaled to."""
    from dflash_ray.train.schedule import passes

    tr = cfg.train
    stand_in = tr.lost_streams == "stand_in"
    per_node = max(1, cfg.plan.gpus_per_node // stream_gpus(cfg))
    out: dict[str, Any] = {}
    for name, lost in (("one_gpu_lost", 1), ("one_node_lost", per_node)):
        placed = tr.num_streams - lost
        if placed < 1:
            out[name] = {"streams_placed": 0, "goes_on": False, "why": "no stream is left"}
            continue
        floor = tr.min_streams or tr.num_streams
        # where train.min_streams stops the run, the step is priced as with it set low enough
        training, row = balanced_count(sharding.kind, placed, per_node, tr.num_streams, floor, stand_in)
        fewer = dataclasses.replace(cfg, train=dataclasses.replace(tr, num_streams=training, min_streams=None))
        # hsdp's rows shorter than a node (7 and 7 of 8 and 7 placed) priced as a row to a node
        rows = dataclasses.replace(sharding, per_node=min(per_node, row)) if sharding.kind == "hsdp" else sharding
        priced = price(fewer, hf, rows, longest, mean, stragglers, scale)
        step = priced["_step"]
        n = passes(training, tr.num_streams) if stand_in else 1
        # the cross-row all-reduce is made once a step; the compute and the in-row traffic every pass
        across = step["traffic_s"].get("replicate", 0.0)
        in_row = sum(step["traffic_s"].values()) - across
        exposed_across = step["traffic_exposed_s"] * across / (across + in_row) if across + in_row else 0.0
        step_s = (n * (step["step_s"] - exposed_across) + exposed_across) * calm_s / calm["step_s"]
        batch = (tr.num_streams if stand_in else training) * tr.batch_size
        out[name] = {
            "streams_placed": placed,
            "streams_training": training,  # the others placed and idle: the mesh's rows are one size
            "goes_on": placed >= floor,
            "why": f"{placed} placed of {tr.num_streams} ({training} train, in rows of one size), "
            f"train.min_streams={floor}, train.lost_streams={tr.lost_streams}"
            + ("" if placed >= floor else ": the run waits for the GPUs (or set train.min_streams lower)"),
            "mesh": priced["mesh"],
            "passes": n,
            "global_batch": batch,
            "fits": priced["fits"],
            "peak_gb": priced["peak_gb"],
            "step_s": simulate_job.significant(step_s),
            "over_calm": round(step_s / calm_s, 3),
            "samples_per_s": simulate_job.significant(batch / step_s),
        }
    return out
