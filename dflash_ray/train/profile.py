"""Where a step's time goes: torch profiler traces of chosen steps (`train.profile_steps`), the
model FLOPs utilisation of a drafter step, and the one line a step prints on the driver."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Iterator

import torch


@contextlib.contextmanager
def traced(uri: str | None) -> Iterator[None]:
    """Trace the block with torch.profiler (CPU, and CUDA on a GPU) into a Chrome trace at `uri`
    (open it in Perfetto or chrome://tracing); None: no trace, no overhead."""
    if uri is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    from dflash_ray import storage

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        yield
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            storage.write_bytes(uri, f.read())


def step_trace(profile_steps: list[int], output: str, step: int, role: str, rank: int) -> str | None:
    """Where the trace of `role` rank `rank` at `step` (0-based) goes when `train.profile_steps` lists
    it (under `output`: its drafter's; a target's and a stream's, the first drafter's), else None."""
    return trace_uri(output, step + 1, role, rank) if step + 1 in profile_steps else None


def trace_uri(output: str, step: int, role: str, rank: int) -> str:
    """The trace of `role` rank `rank` at `step` (1-based, as the metrics count): OUTPUT/profile/."""
    from dflash_ray import storage

    return storage.join(output, "profile", f"step-{step:06d}-{role}-{rank}.json")


def peak_flops(device: torch.device | str) -> float | None:
    """The dense bf16 peak FLOP/s of `device` when it is a GPU `plan` knows (H100, H200, B200)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    from dflash_ray.gpus import GPUS

    name = torch.cuda.get_device_name(device)
    return next((gpu.bf16_tflops * 1e12 for key, gpu in GPUS.items() if key in name), None)


def flops_per_position(drafter: torch.nn.Module, head_VH: torch.Tensor) -> int:
    """A drafted position's training FLOPs: 6 per trainable weight (forward, and the backward to the
    inputs and the weights), 4 per entry of the frozen head (forward and the backward to its input).
    Attention's own FLOPs are left out, as MFU usually counts."""
    return 6 * sum(p.numel() for p in drafter.parameters() if p.requires_grad) + 4 * head_VH.numel()


def step_line(row: dict[str, Any], total: int) -> str:
    """`step 12/200  loss 3.214  tau 1.84  9,120 tok/s  mfu 31.2%  1.20 s/step`."""
    parts = [
        f"step {row['step']}/{total}",
        f"loss {row['loss']:.4g}",
        f"tau {row['tau']:.2f}",
        f"{row['tokens_per_s']:,.0f} tok/s",
    ]
    if row.get("mfu") is not None:
        parts.append(f"mfu {100 * row['mfu']:.1f}%")
    parts.append(f"{row['step_seconds']:.2f} s/step")
    if row.get("heldout_tau") is not None:
        parts.append(f"heldout tau {row['heldout_tau']:.2f}")
    return "  ".join(parts)
