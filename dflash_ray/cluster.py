"""Joining or starting the Ray cluster a stage runs on."""

from __future__ import annotations

import os

from dflash_ray.config import RayConfig
from dflash_ray.errors import DFlashError


def connect(cfg: RayConfig, *, existing: bool = False) -> None:
    """Join the cluster named by config or `RAY_ADDRESS` (as under `ray job submit`), else start a
    local one (`existing`: else join the one running on this machine). A driver that already called
    `ray.init` keeps its cluster."""
    import ray

    if ray.is_initialized():
        return
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    if existing:
        try:
            ray.init(address="auto", log_to_driver=False)
        except ConnectionError:
            raise DFlashError("no Ray cluster is running here; set ray.address or RAY_ADDRESS",
                              field="ray.address") from None
        return
    ray.init(num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory,
             include_dashboard=cfg.include_dashboard)
