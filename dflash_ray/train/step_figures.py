"""A training run's figures: each step's metric row from every stream's statistics, the live gauges
the Ray dashboard shows (`ray.util.metrics`, per run and per drafter), and what a drafter's summary
and the samples' count say at the end."""

from __future__ import annotations

import collections
from typing import Any

from dflash_ray.train import checkpoint


def step_row(step: int, stats: list[dict[str, Any]], wait_s: float, step_s: float, streams: int) -> dict[str, Any]:
    """The metric row of `step` from each stream's drafter statistics (`DrafterWorker.train_step`)."""
    tokens = sum(s["tokens"] for s in stats)
    row = {
        "step": step,
        "loss": stats[0]["loss"],
        "lr": stats[0]["lr"],
        "grad_norm": stats[0]["grad_norm"],
        "tau": sum(s["tau"] for s in stats) / len(stats),
        "acc_k1": sum(s["acc_k1"] for s in stats) / len(stats),
        "target_seconds": max(s["target_seconds"] for s in stats),
        "handoff_seconds": max(s["handoff_seconds"] for s in stats),
        "read_bytes": sum(s["read_bytes"] for s in stats),  # tokenized data the targets read
        # the longest stream's target tokens over the mean (the step waits for the longest)
        "straggler_ratio": max(s["tokens"] for s in stats) / max(1e-9, tokens / len(stats)),
        "drafter_seconds": max(s["drafter_seconds"] for s in stats),
        "optimizer_seconds": max(s["optimizer_seconds"] for s in stats),
        "wait_seconds": wait_s,
        "step_seconds": step_s,
        "tokens_per_s": tokens / max(step_s, 1e-9),
        "streams": streams,  # the streams placed for it (`elastic`)
    }
    peaks = [s["peak_flops"] for s in stats]
    if all(peaks):  # the drafters' model FLOPs over what their GPUs could do in the step
        row["mfu"] = sum(s["flops"] for s in stats) / (step_s * sum(peaks))
    return row


class Gauges:
    """`dflash_train_<figure>` gauges of one drafter of one run (two runs on one cluster, and the
    drafters of one run, stay apart by their tags)."""

    def __init__(self, run: str, drafter: str):
        self.tags = {"run": run, "drafter": drafter or "drafter"}
        self.gauges: dict[str, Any] = {}

    def set(self, name: str, value: float) -> None:
        from ray.util.metrics import Gauge

        if name not in self.gauges:
            gauge = Gauge(f"dflash_train_{name}", description=f"training {name}", tag_keys=("run", "drafter"))
            gauge.set_default_tags(self.tags)
            self.gauges[name] = gauge
        self.gauges[name].set(value)

    def show(self, row: dict[str, Any]) -> None:
        for k, v in row.items():
            if k != "step":
                self.set(k, v)


def team_summary(team: Any, checkpoint: str) -> dict[str, Any]:
    """A drafter's figures at the end of a run (`streams.Team`), its newest checkpoint beside them."""
    last = team.metrics[-1] if team.metrics else {}
    heldout = [m for m in team.metrics if m.get("heldout_tau") is not None]
    ratios = [m["straggler_ratio"] for m in team.metrics if "straggler_ratio" in m]
    return {
        "output": team.output,
        "loss": last.get("loss"),
        "tau": last.get("tau"),
        "straggler_ratio": round(sum(ratios) / len(ratios), 3) if ratios else None,
        "read_bytes": sum(m.get("read_bytes", 0) for m in team.metrics),
        "rendezvous": f"{team.rendezvous[0]}:{team.rendezvous[1]}" if team.rendezvous else None,
        "heldout_tau": heldout[-1]["heldout_tau"] if heldout else None,
        "heldout_tau_first": heldout[0]["heldout_tau"] if heldout else None,
        "heldout_tau_start": team.heldout_start,
        "checkpoint": checkpoint,
    }


def times_taken(taken: dict[int, list], of: int) -> dict[str, int]:
    """How often each training sample was taken by the steps run (`taken`: step -> its samples; those
    a restart took again counted once): whole epochs take each of the `of` samples `epochs` times,
    whatever number of streams each step ran on."""
    counts = collections.Counter(x for samples in taken.values() for x in samples)
    return {
        "steps": len(taken),
        "taken": sum(counts.values()),
        "distinct": len(counts),
        "of": of,
        "min_times": min(counts.values(), default=0),
        "max_times": max(counts.values(), default=0),
    }


def summary_of(run: Any, tracked: Any, seconds: float) -> dict[str, Any]:
    """What a run (`Coordinator`) reports when it ends: its steps, restarts and their costs, the
    streams and nodes, the layout, the samples taken, and each drafter's figures."""
    import ray

    wanted = run.cfg.train.num_streams
    out = {
        "stage": "train",
        "output": run.output,
        "step": run.step,
        "total_steps": run.total_steps,
        "restarts": run.restarts,
        "failures": run.failures,
        "resumed_from": run.resumed_from,
        "slow_target_kernels": run.streams.slow_kernels,
        "seconds_lost": round(run.seconds_lost, 1),
        "restart_seconds": run.restart_seconds,
        "streams": run.streams.count,
        "lost_nodes": run.streams.lost,
        "steps_on_fewer_streams": sum(m.get("streams", wanted) < wanted for m in run.metrics),
        "grew_back": run.grew_back,
        "deadlines_missed": run.streams.deadlines.missed,
        "warm_up": run.warm,
        "samples": times_taken(run.taken, len(run.samples.train)),
        "coordinator_node": ray.util.get_node_ip_address(),
        "stream_nodes": sorted(run.streams.nodes),
        "layout": {"kind": run.streams.sharding, "rows": run.streams.rows},
        "seconds": round(seconds, 1),
        "trackers": tracked,
    }
    summaries = [team_summary(team, checkpoint.step_dir(team.output, run.step)) for team in run.teams]
    if run.cfg.train.drafters:  # each drafter's figures under its name
        return {**out, "drafters": {team.name: s for team, s in zip(run.teams, summaries)}}
    return {**out, **summaries[0]}
