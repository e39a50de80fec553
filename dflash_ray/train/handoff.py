"""Features from a target to its drafters over torch.distributed send/recv, not through the object store.

A paired run's stream actors form one process group (`train.feature_transport=direct`): the
targets are ranks 0..N-1 and drafter s of team t is rank N + t·N + s (`Layout`). Each drafter's
ranks also form a subgroup of their own, which its FSDP sharding and loss all-reduce use. A target
posts its batch's tensors as non-blocking sends to its stream's drafters and returns only their
shapes and dtypes (`Sent.meta`, a few hundred bytes through Ray); a drafter allocates buffers of
exactly those shapes and receives into them. NCCL between GPUs (NVLink on a node, EFA across
nodes), gloo on the CPU; nothing is pickled or copied into shared memory.

NCCL ignores tags: the messages of a pair must be received in the order they were sent, which the
coordinator keeps (each stream's batches in step order, every drafter receiving each one). Every
send and receive goes through the process's `p2p.Ledger`, which holds a CPU run to NCCL's rules
(a send completes only once its receive is posted; a device synchronization waits for it). No Ray here.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """Global ranks of a paired run's stream actors: N targets, then each team's N drafters."""

    streams: int
    teams: int
    # the drafters' mesh (`train/mesh.py`) as stream indices, rows replicating one another; () or one
    # row: every drafter rank shards the weights
    rows: tuple[tuple[int, ...], ...] = ()

    @property
    def world(self) -> int:
        return self.streams * (1 + self.teams)

    def target(self, stream: int) -> int:
        return stream

    def drafter(self, team: int, stream: int) -> int:
        return self.streams * (1 + team) + stream

    def team_ranks(self, team: int) -> list[int]:
        return [self.drafter(team, s) for s in range(self.streams)]

    def team_rows(self, team: int) -> list[list[int]]:
        """The team's mesh rows as global ranks; [] where its ranks form one row."""
        if len(self.rows) < 2:
            return []
        return [[self.drafter(team, s) for s in row] for row in self.rows]


def join(
    backend: str, address: str, port: int, rank: int, layout: Layout, timeout_s: float, watchdog_s: float | None = None
) -> tuple[list[Any], list[Any], list[tuple]]:
    """Join the run's process group as `rank`, then make every team's subgroups (collective: every
    rank makes all of them, in order): one on the run's backend for training, one over gloo for
    checkpoints (`checkpoint_files`), and its mesh's rows and columns where it has several rows
    (`fsdp.make_mesh_groups`). Returns the three lists, one entry per team each. `watchdog_s`: the ledger's
    NCCL watchdog (`p2p`) when it runs on another clock than the CPU's collectives (`train.clocks`)."""
    import torch.distributed as dist

    from dflash_ray.train import p2p
    from dflash_ray.train.fsdp import make_mesh_groups

    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=layout.world, timeout=timeout
    )
    p2p.start(rank, backend, watchdog_s or timeout_s)
    groups = [dist.new_group(layout.team_ranks(t), timeout=timeout) for t in range(layout.teams)]
    ckpt = [dist.new_group(layout.team_ranks(t), timeout=timeout, backend="gloo") for t in range(layout.teams)]
    return groups, ckpt, [make_mesh_groups(layout.team_rows(t), timeout) for t in range(layout.teams)]


def greet(peers: list[int], sending: bool, device: str) -> None:
    """One small blocking message to (or from) each peer, in order, while every rank is still in its
    join call. NCCL opens a pair's communicator on the pair's first send/recv and blocks both sides
    until the other arrives; a target's first `send` must not meet that, since its drafter posts the
    matching receive only after the target has returned (gloo connects every pair at once)."""
    from dflash_ray.train import p2p

    ledger = p2p.ledger()
    assert ledger is not None  # this process joined the run's process group
    token = torch.zeros(1, device=device)
    for peer in peers:
        (ledger.send(token, peer, "greeting") if sending else ledger.recv(token, peer)).wait()


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


@dataclass
class Sent:
    """Sends posted by a target: their tensors stay alive here until every receiver has them."""

    meta: dict[str, Any]  # key -> (shape, dtype name): what a receiver allocates
    works: list[Any] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    sends: list[tuple[int, int]] = field(default_factory=list)  # (peer, ordinal) in the ledger

    def done(self) -> bool:
        """Every receiver has it (under NCCL's rules: its receive is posted, and the data went)."""
        from dflash_ray.train import p2p

        ledger = p2p.ledger()
        assert ledger is not None  # this process joined the run's process group
        if not ledger.enforce:
            return all(w.is_completed() for w in self.works)
        if ledger.unmatched(self.sends):
            return False
        for w in self.works:  # matched: gloo's send finishes writing (its `is_completed` stays False until waited)
            w.wait()
        return True


def send(batch: dict[str, torch.Tensor], dsts: list[int]) -> Sent:
    """Post non-blocking sends of every tensor of `batch` (sorted by key) to each of `dsts`."""
    from dflash_ray.train import p2p

    ledger = p2p.ledger()
    assert ledger is not None  # this process joined the run's process group
    sent = Sent({k: (list(batch[k].shape), str(batch[k].dtype)) for k in sorted(batch)})
    for key in sorted(batch):
        tensor = batch[key].contiguous()
        sent.tensors.append(tensor)
        for dst in dsts:
            sent.works.append(ledger.send(tensor, dst, f"the features' {key!r}"))
            sent.sends.append((dst, ledger.last(dst)))
    return sent


def receive(meta: dict[str, Any], src: int, device: str) -> dict[str, torch.Tensor]:
    """The tensors a target sent (`send`'s meta, in its key order), received into buffers of their
    exact shapes on `device`; returned once they are there (on a GPU, `wait` only orders the
    compute stream after NCCL's: the stream is synchronized so the caller's clock sees the transfer)."""
    from dflash_ray.train import p2p
    from dflash_ray.train.devices import wait_compute

    ledger = p2p.ledger()
    assert ledger is not None  # this process joined the run's process group
    batch = {k: torch.empty(shape, dtype=_dtype(dtype), device=device) for k, (shape, dtype) in sorted(meta.items())}
    works = [ledger.recv(batch[k], src) for k in sorted(batch)]
    for w in works:
        w.wait()
    wait_compute(device)
    return batch


def nbytes(meta: dict[str, Any]) -> int:
    """Bytes a receiver takes in for `meta`."""
    total = 0
    for shape, dtype in meta.values():
        count = 1
        for n in shape:
            count *= n
        total += count * _dtype(dtype).itemsize
    return total


def taken(batch: dict[str, Any], source: int | None, device: str) -> dict[str, Any]:
    """What a drafter trains on: the batch itself (its features came as an object), or the tensors
    its target (global rank `source`) sent, received now (`receive`), with the time that took."""
    import time

    if "meta" not in batch:
        return batch
    assert source is not None  # set by the drafter's `join_run`, which every send/recv run calls first
    start = time.perf_counter()
    received = receive(batch["meta"], source, device)
    return {
        **received,
        "seconds": batch["seconds"],
        "read_bytes": batch["read_bytes"],
        "handoff_seconds": time.perf_counter() - start,
    }
