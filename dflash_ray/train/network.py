"""The network the drafters' collectives will get, measured from the driver: one probe per training
stream placed where its drafter would run (`train/netprobe.py` measures), the whole group's and every
node pair's all-reduce bus bandwidth, and the floor (`train.min_bus_bandwidth`) a pair must reach.
`dflash-ray netcheck` reports it; `train` measures first and refuses a slow pair before it starts."""

from __future__ import annotations

from typing import Any

from dflash_ray.config import TrainConfig
from dflash_ray.errors import DFlashError

MEGABYTES = 64.0  # per rank: past NCCL's latency-bound sizes, so the figure is the link's


def measure(tcfg: TrainConfig, megabytes: float = MEGABYTES, iters: int = 5) -> dict[str, Any]:
    """Place the probes, measure, free them. Needs a connected Ray and `num_streams` >= 2."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    import dataclasses

    from dflash_ray.train.streams import first_error, node_of, rendezvous_of
    from dflash_ray.train.elastic import place_streams
    from dflash_ray.train.devices import stream_bundles
    from dflash_ray.train.netprobe import NetProbe, bus_bandwidth, node_pairs

    n, bundles = tcfg.num_streams, stream_bundles(tcfg)
    index = 0 if tcfg.colocate else 1  # the drafter's bundle: where the collectives run
    groups: list[Any] = []  # placement groups
    probes: list[Any] = []  # actor handles: Ray's typing does not give their methods a `.remote`
    try:  # every stream's probe, or none: the measure is of the whole run's network
        groups = place_streams(dataclasses.replace(tcfg, min_streams=None), bundles, "probes")
        for s in range(n):
            probes.append(
                ray.remote(NetProbe)
                .options(
                    num_cpus=tcfg.actor_cpus,
                    num_gpus=bundles[index].get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(groups[s], placement_group_bundle_index=index),
                )
                .remote(tcfg, s, n)
            )
        nodes = ray.get([p.__ray_call__.remote(node_of) for p in probes])
        address, port = ray.get(probes[0].__ray_call__.remote(rendezvous_of))
        first_error([p.join.remote(address, port) for p in probes])
        nbytes = int(megabytes * 1e6) // 4 * 4
        pairs = node_pairs(nodes)
        seconds = first_error([p.measure.remote(pairs, nbytes, iters) for p in probes])
    finally:
        for probe in probes:
            ray.kill(probe)
        for pg in groups:
            remove_placement_group(pg)
    slowest = max(s["all"] for s in seconds)  # a collective ends when its slowest rank does
    rows = []
    for a, b in pairs:
        pair_s = max(seconds[a][f"{a}-{b}"], seconds[b][f"{a}-{b}"])
        rows.append(
            {
                "ranks": [a, b],
                "nodes": [nodes[a], nodes[b]],
                "within_node": nodes[a] == nodes[b],
                "bus_gbs": round(bus_bandwidth(nbytes, pair_s, 2), 3),
                "seconds": round(pair_s, 6),
            }
        )
    return {
        "stage": "netcheck",
        "ranks": n,
        "nodes": nodes,
        "bytes": nbytes,
        "iters": iters,
        "all_reduce_bus_gbs": round(bus_bandwidth(nbytes, slowest, n), 3),
        "all_reduce_seconds": round(slowest, 6),
        "pairs": rows,
        "slowest_pair": min(rows, key=lambda r: r["bus_gbs"]) if rows else None,
    }


def check_floor(summary: dict[str, Any], floor: float) -> None:
    """Refuse when the slowest node pair, or the whole group, is below `floor` GB/s."""
    if floor <= 0:
        return
    below = [r for r in summary["pairs"] if r["bus_gbs"] < floor]
    if below:
        worst = min(below, key=lambda r: r["bus_gbs"])
        where = (
            f"within node {worst['nodes'][0]}"
            if worst["within_node"]
            else f"between nodes {worst['nodes'][0]} and {worst['nodes'][1]}"
        )
        raise DFlashError(
            f"the link {where} carries {worst['bus_gbs']:g} GB/s of "
            f"all-reduce bus bandwidth, below the floor of {floor:g} GB/s ({len(below)} of {len(summary['pairs'])} "
            "pairs below): NCCL may have fallen back to sockets (no EFA device or OFI plugin on a node); "
            "`dflash-ray netcheck --json` shows every pair",
            field="train.min_bus_bandwidth",
        )
    if summary["all_reduce_bus_gbs"] < floor:
        raise DFlashError(
            f"the training ranks' all-reduce carries {summary['all_reduce_bus_gbs']:g} GB/s of bus "
            f"bandwidth, below the floor of {floor:g} GB/s",
            field="train.min_bus_bandwidth",
        )
