"""Where a training role runs and how its tensors travel: pure functions of what the actor holds.

Ray sets `CUDA_VISIBLE_DEVICES` for an actor that asks for GPUs, so inside it the first GPU it
holds is always `cuda:0`; an actor that asks for none stays on the CPU even on a GPU node. Every
decision below takes the actor's GPU share and the CUDA device count it sees, so it can be tested
for CPU-only, one-GPU and several-GPU actors on any machine. No Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError


@dataclass(frozen=True, slots=True)
class Placement:
    device: str  # "cpu" or "cuda:0"
    num_devices: int  # GPUs the role spreads over (a target too big for one GPU); 1 on CPU
    dtype: torch.dtype  # compute dtype: the target's weights, the drafter's autocast
    backend: str  # torch.distributed backend among drafters: "nccl" | "gloo"
    attention: str  # drafter attention in training: "flex" (compiled, CUDA) | "sdpa" (dense mask)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def placement(actor_gpus: float, cuda_devices: int, dtype: str = "auto", attention: str = "auto") -> Placement:
    """The placement of a role that holds `actor_gpus` GPUs and sees `cuda_devices` CUDA devices.

    `dtype="auto"`: bf16 on a GPU, fp32 on the CPU (CPU bf16 matmuls are slow and CPU results must
    stay bit-reproducible). `attention="auto"`: compiled flex attention on a GPU, the dense SDPA mask
    on the CPU, where flex attention's backward does not run.
    """
    if actor_gpus > 0 and cuda_devices < 1:
        raise ValueError(f"the actor holds {actor_gpus} GPU(s) but CUDA sees none: is this torch a CPU build?")
    on_gpu = actor_gpus > 0
    if attention == "flex" and not on_gpu:
        raise ValueError(
            "train.attention=flex needs GPU actors (train.actor_gpus > 0): flex attention's "
            "backward does not run on the CPU; use sdpa or auto"
        )
    chosen_dtype = {
        "auto": torch.bfloat16 if on_gpu else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[dtype]
    return Placement(
        device="cuda:0" if on_gpu else "cpu",
        num_devices=max(1, min(int(actor_gpus), cuda_devices)) if on_gpu else 1,
        dtype=chosen_dtype,
        backend="nccl" if on_gpu else "gloo",
        attention=("flex" if on_gpu else "sdpa") if attention == "auto" else attention,
    )


def target_gpus(cfg) -> float:
    """GPUs of one target actor (`train.target_gpus`, else `train.actor_gpus`)."""
    return cfg.actor_gpus if cfg.target_gpus is None else cfg.target_gpus


def actor_placement(cfg, *, target: bool = False) -> Placement:
    """This process's placement for the training config `cfg` (a `TrainConfig`); `target`: a target
    actor's, which may spread over several GPUs."""
    return placement(
        target_gpus(cfg) if target else cfg.actor_gpus,
        torch.cuda.device_count() if torch.cuda.is_available() else 0,
        cfg.dtype,
        cfg.attention,
    )


def synchronize(device: str) -> None:
    """Wait for every stream of the device, NCCL's included: under NCCL's rules (`p2p`) this waits
    for the rank's own pending sends to be received, so a rank that sends must use `wait_compute`."""
    from dflash_ray.train import p2p

    p2p.settle()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def wait_compute(device: str) -> None:
    """Wait for the compute stream's queued work alone (not NCCL's), so wall-clock timings mean what
    they say without waiting on a peer's receive."""
    if device.startswith("cuda"):
        torch.cuda.current_stream(device).synchronize()


def planned_placement(cfg: RunConfig):
    """The placement the stream actors will choose, checked on the driver (which may hold no GPU)."""
    tcfg = cfg.train
    try:
        return placement(tcfg.actor_gpus, 1 if tcfg.actor_gpus > 0 else 0, tcfg.dtype, tcfg.attention)
    except ValueError as e:
        raise DFlashError(str(e), field="train.attention") from None


def stream_bundles(cfg) -> list[dict[str, float]]:
    """The resources of one stream's actors (target, then one drafter per drafter of the run; or the
    one colocated actor), which a placement group packs on one node."""
    from dflash_ray.cluster import on_node

    def bundle(gpus: float) -> dict[str, float]:
        return {"CPU": cfg.actor_cpus, **({"GPU": gpus} if gpus else {}), **on_node(cfg.node_resource)}

    if cfg.colocate:
        return [bundle(cfg.actor_gpus)]
    return [bundle(target_gpus(cfg))] + [bundle(cfg.actor_gpus) for _ in range(max(1, len(cfg.drafters)))]


def check_resources(cfg, nodes: list[dict[str, float]]) -> None:
    """Refuse, before any actor starts, streams that the cluster's nodes (each one's total resources)
    can never hold: naming what one stream asks for, what the nodes have, and the settings to change.
    Without it the placement would wait for resources that never come."""
    need: dict[str, float] = {}
    for bundle in stream_bundles(cfg):
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount

    def fits(node: dict[str, float]) -> int:
        return int(min(node.get(k, 0.0) / v for k, v in need.items() if v > 0) + 1e-9)

    asked = ", ".join(f"{v:g} {k}" for k, v in sorted(need.items()))
    have = "; ".join(", ".join(f"{n.get(k, 0.0):g} {k}" for k in sorted(need)) for n in nodes) or "no node"
    room = sum(fits(n) for n in nodes)
    if room < cfg.num_streams:
        raise DFlashError(
            f"{cfg.num_streams} training stream(s) need {asked} each, on one node; the cluster's nodes have "
            f"{have}: room for {room}. Lower train.actor_cpus or train.actor_gpus, train.num_streams, or set "
            "train.colocate=true (one actor per stream), or add nodes",
            field="train.actor_cpus",
        )
