"""Elastic streams: a lost node costs streams, not the run.

`torch.distributed.checkpoint` reshards on load and `Schedule` goes on from where a checkpoint
stood whatever the number of streams, so a run resumed on fewer streams takes every sample of the
epoch once. So when a restart cannot place all of `train.num_streams` within
`train.placement_timeout_s` (a node lost and not yet replaced), it goes on with the streams that
were placed, down to `train.min_streams`: each taking a batch a step, the global batch smaller
(`train.lost_streams=shrink`), or standing in for the others (`stand_in`, `schedule.slots`: the same
steps, samples and learning rates, at more passes a step). The streams not placed stay asked for,
so Ray's autoscaler keeps their demand; once they are placed (the capacity returned by it or a
person), the run grows back at its next checkpoint, without counting a failure. Where the placed
streams lie unevenly on the nodes (8 and 7 a node), the run trains on a balanced share of them
(`mesh.balanced`: two rows of 7 under shrink) and keeps the others placed and idle, until a stream
placed again balances more.
"""

from __future__ import annotations

import logging
from dflash_ray.errors import DFlashError

log = logging.getLogger(__name__)


def place_streams(tcfg, bundles: list[dict], what: str = "actors") -> list:
    """STRICT_PACK placement groups (a stream's bundles on one node) for `train.num_streams`
    streams, all asked for at once and waited for together, returned once all are placed or
    `train.placement_timeout_s` has passed with at least `train.min_streams` placed (`placed` tells
    which); otherwise none (all removed), and an error naming the bundles and what the cluster has
    free. The groups not placed stay asked for: the autoscaler keeps their demand, and the run grows
    back when they are placed (`Streams.grown`)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    wanted = tcfg.num_streams
    floor = tcfg.min_streams or wanted
    groups = [placement_group(bundles, strategy="STRICT_PACK") for _ in range(wanted)]
    refs = [g.ready() for g in groups]
    ready, _ = ray.wait(refs, num_returns=wanted, timeout=tcfg.placement_timeout_s)
    placed = [g for g, ref in zip(groups, refs) if ref in ready]
    if len(placed) < floor:
        for g in groups:
            remove_placement_group(g)
        missing = wanted - len(placed)
        raise DFlashError(
            f"{missing} of {wanted} streams' {what} ({bundles}, each stream on one node) were not placed in "
            f"{tcfg.placement_timeout_s:g} s (at least {floor} must be: train.min_streams): the cluster has "
            f"{ray.available_resources()} free; other work holds the rest, or the autoscaler cannot add such a node",
            field="train.placement_timeout_s",
        )
    if len(placed) < wanted:
        log.warning(
            "%d of %d streams placed in %g s: the run goes on with %d (train.min_streams=%d)",
            len(placed),
            wanted,
            tcfg.placement_timeout_s,
            len(placed),
            floor,
        )
    return groups


def placed(groups: list) -> list:
    """Those of `groups` placed now, as the cluster's table says (a group stays asked for until it
    is removed; `ready()` would start a task each look)."""
    from ray.util import placement_group_table

    return [g for g in groups if placement_group_table(g).get("state") == "CREATED"]


def nodes_of(groups: list) -> list[str]:
    """The address of the node each placement group's bundles were given (a stream's bundles share
    one: STRICT_PACK), in order, "" for a node no longer listed; known at placement, before any
    actor on them answers (a node lost while its actors start is still named)."""
    import ray
    from ray.util import placement_group_table

    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    out = []
    for g in groups:
        ids = list(placement_group_table(g)["bundles_to_node_id"].values())
        out.append(address.get(ids[0], "") if ids else "")
    return out


def lost_nodes(addresses: set[str]) -> list[str]:
    """Which of the node addresses the run's streams used are no longer alive in the cluster."""
    import ray

    alive = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return sorted(a for a in addresses if a not in alive)
