"""What the drafters' collectives will get from the network: all-reduce bus bandwidth over the
training ranks, and between one rank on each node of every node pair, measured before training.

Bus bandwidth is nccl-tests' figure: the bytes each rank all-reduces over the time, times
2(n-1)/n, so that it reads as a link's speed whatever the number of ranks (for 2 ranks it is the
algorithm bandwidth). A cross-node pair far below the others is a node whose NCCL fell back to
sockets (no EFA device or OFI plugin), the failure that otherwise shows only as a slow run. No Ray
here: `stages/netcheck.py` places one probe per training stream where its drafter would run.
"""

from __future__ import annotations

import datetime
import time

import torch

from dflash_ray.config import TrainConfig
from dflash_ray.train.devices import actor_placement, synchronize


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> float:
    """GB/s (10^9 bytes) of an all-reduce of `nbytes` per rank over `ranks` ranks taking `seconds`."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def node_pairs(nodes: list[str]) -> list[tuple[int, int]]:
    """The rank pairs to measure, given each rank's node: two ranks of one node, for every node that
    has two (its own interconnect), then the first rank of each node with the first of every other."""
    first: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, []).append(rank)
    within = [(ranks[0], ranks[1]) for ranks in first.values() if len(ranks) > 1]
    heads = [ranks[0] for ranks in first.values()]
    return within + [(a, b) for i, a in enumerate(heads) for b in heads[i + 1 :]]


class NetProbe:
    """One rank of the measurement, on the device (and with the backend) its drafter would use."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int):
        self.place = actor_placement(cfg)
        self.rank, self.world, self.timeout_s = rank, world, cfg.collective_timeout_s

    def join(self, address: str, port: int) -> None:
        import torch.distributed as dist

        dist.init_process_group(
            self.place.backend,
            init_method=f"tcp://{address}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )

    def _timed(self, buf: torch.Tensor, iters: int, group=None) -> float:
        """Seconds of one all-reduce of `buf` in `group`, the mean of `iters` after one to warm up."""
        import torch.distributed as dist

        dist.all_reduce(buf, group=group)
        synchronize(self.place.device)
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf, group=group)
        synchronize(self.place.device)
        return (time.perf_counter() - start) / iters

    def measure(self, pairs: list[tuple[int, int]], nbytes: int, iters: int) -> dict:
        """Every rank calls it: the whole group's all-reduce, then each pair's alone (the others wait
        at a barrier, so no two pairs share a link). This rank's seconds: {"all": s, "a-b": s, ...}."""
        import torch.distributed as dist

        buf = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=self.place.device)
        seconds = {"all": self._timed(buf, iters)}
        for a, b in pairs:
            group = dist.new_group([a, b])  # every rank creates every group, in the same order
            if self.rank in (a, b):
                seconds[f"{a}-{b}"] = self._timed(buf, iters, group)
            dist.barrier()
        dist.destroy_process_group()
        return seconds
