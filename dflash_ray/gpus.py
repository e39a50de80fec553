"""The GPUs the plan and the profiler know: memory, dense bf16 peak, HBM and NVLink figures. A table
of facts below every reader (`simulate.py` prices steps with it, `train/profile.py` reads a step's
share of the peak, `settings/plan.py` lists the names `plan.gpu` takes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float  # what the device reports (nvidia-smi), in 1e9 bytes
    bf16_tflops: float  # dense bf16 peak
    bandwidth_tbs: float  # HBM
    nvlink_gb_per_s: float  # all-reduce bus bandwidth between a node's GPUs (NCCL over NVLink)


# the peaks from the vendors' datasheets; memory as the driver reports it; NVLink at 80% of its
# one-way figure (NVLink 4: 450 GB/s, NVLink 5: 900 GB/s), what NCCL's all-reduce tests reach on a node
GPUS = {
    "H100": Gpu("H100", 85.5, 989.0, 3.35, 360.0),
    "H200": Gpu("H200", 150.7, 989.0, 4.8, 360.0),
    "B200": Gpu("B200", 192.3, 2250.0, 8.0, 720.0),
}
