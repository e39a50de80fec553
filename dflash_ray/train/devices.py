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
        raise ValueError("train.attention=flex needs GPU actors (train.actor_gpus > 0): flex attention's "
                         "backward does not run on the CPU; use sdpa or auto")
    chosen_dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "float32": torch.float32,
                    "bfloat16": torch.bfloat16}[dtype]
    return Placement(
        device="cuda:0" if on_gpu else "cpu",
        num_devices=max(1, min(int(actor_gpus), cuda_devices)) if on_gpu else 1,
        dtype=chosen_dtype,
        backend="nccl" if on_gpu else "gloo",
        attention=("flex" if on_gpu else "sdpa") if attention == "auto" else attention,
    )


def actor_placement(cfg) -> Placement:
    """This process's placement for the training config `cfg` (a `TrainConfig`)."""
    return placement(cfg.actor_gpus, torch.cuda.device_count() if torch.cuda.is_available() else 0,
                     cfg.dtype, cfg.attention)


def synchronize(device: str) -> None:
    """Wait for queued GPU work, so wall-clock timings mean what they say."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def planned_placement(cfg: RunConfig):
    """The placement the stream actors will choose, checked on the driver (which may hold no GPU)."""
    tcfg = cfg.train
    try:
        return placement(tcfg.actor_gpus, 1 if tcfg.actor_gpus > 0 else 0, tcfg.dtype, tcfg.attention)
    except ValueError as e:
        raise DFlashError(str(e), field="train.attention") from None
