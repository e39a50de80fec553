"""`dflash-ray netcheck`: the all-reduce bus bandwidth the drafters' collectives will get, measured
over probes placed as the training streams are (one per stream, in its drafter's bundle, on
`train.node_resource` nodes), for the whole group and for every node pair (`train/netprobe.py`).

`train.min_bus_bandwidth` (GB/s) is the floor: `dflash-ray train` (and the pipeline's training)
measures first and refuses to start when a node pair is below it, naming the pair, rather than
crawling for hours over a socket fallback. 0 (the default) measures nothing.

`--storage URI` measures instead the rate a training node reads a model folder at, in the ranged
reads a stream's start-up makes: the figure `plan.storage_gb_per_s` prices the cold start with."""

from __future__ import annotations

import argparse
from typing import Any

from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError
from dflash_ray.stages import Stage
from dflash_ray.train.network import MEGABYTES, check_floor, measure


def run_netcheck(cfg: RunConfig, megabytes: float = MEGABYTES, iters: int = 5) -> dict[str, Any]:
    """The measurement on the cluster `cfg.ray` names, with the floor's verdict (not an error here:
    the figures are what this command is for)."""
    import ray

    from dflash_ray.cluster import connect
    from dflash_ray.train.devices import check_resources

    tcfg = cfg.train
    if iters < 1:
        raise DFlashError(f"{iters}: allowed: >= 1 timed all-reduces", field="--iters")
    if not 0.001 <= megabytes <= 1e5:  # a measurement of bytes, not of latency; and finite
        raise DFlashError(f"{megabytes:g}: allowed: from 0.001 (1 KB) to 100000", field="--megabytes")
    if tcfg.num_streams < 2:
        raise DFlashError("one training stream has no collective to measure", field="train.num_streams")
    connect(cfg.ray)
    check_resources(tcfg, [node["Resources"] for node in ray.nodes() if node.get("Alive")])
    summary = measure(tcfg, megabytes, iters)
    floor = tcfg.min_bus_bandwidth
    try:
        check_floor(summary, floor)
        verdict = None
    except DFlashError as e:
        verdict = str(e)
    return {
        **summary,
        "floor_gbs": floor,
        "above_floor": verdict is None if floor > 0 else None,
        "below_floor": verdict,
    }


def run_storage_check(cfg: RunConfig, uri: str, megabytes: float) -> dict[str, Any]:
    """The rate a training node reads `uri` (a model folder or file) at, in the ranged reads a
    stream's start-up makes (`model_fetch`): `plan.storage_gb_per_s`'s figure."""
    import ray

    from dflash_ray.cluster import connect, on_node
    from dflash_ray.model_fetch import measure

    if not 1 <= megabytes <= 1e6:
        raise DFlashError(f"{megabytes:g}: allowed: from 1 to 1000000 MB read", field="--megabytes")
    connect(cfg.ray)
    task = ray.remote(measure).options(num_cpus=0, resources=on_node(cfg.train.node_resource))
    measured = ray.get(task.remote(uri, int(megabytes * 1e6)))
    return {**measured, "set": f"--set plan.storage_gb_per_s={measured['storage_gb_per_s']}"}


def _netcheck(args, cfg: RunConfig) -> dict[str, Any]:
    if args.storage:
        return run_storage_check(cfg, args.storage, args.megabytes if args.megabytes != MEGABYTES else 4096)
    return run_netcheck(cfg, megabytes=args.megabytes, iters=args.iters)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--megabytes", type=float, default=MEGABYTES, help="all-reduced by each rank (default 64)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces per measurement (default 5)")
    p.add_argument(
        "--storage",
        metavar="URI",
        help="instead, the rate a training node reads this model folder at (ranged reads; the first "
        "--megabytes of its largest file, default 4096): plan.storage_gb_per_s",
    )


STAGES = (
    Stage(
        name="netcheck",
        help="all-reduce bus bandwidth between the training ranks, per node pair (train.min_bus_bandwidth)",
        command=_netcheck,
        arguments=_arguments,
        section="train",
        order=91,
    ),
)
