"""The GPUs a Ray cluster launcher YAML offers `dflash-ray plan`: each node type's `resources.GPU`
times its `max_workers`, summed over the types marked `gen_node` and over those marked `train_node`.
Every count is a whole number in a range a real cluster has, refused otherwise naming the key."""

from __future__ import annotations

import math
from typing import Any

from dflash_ray.errors import DFlashError

MAX_GPUS_PER_NODE = 64
MAX_WORKERS = 100_000  # of one node type
MAX_GPUS = 1_000_000  # of a stage: the most plan.generation_gpus and plan.training_gpus take


def count_gpus(cfg: Any, uri: str) -> tuple[int, int]:
    """(generation GPUs, training GPUs) of the launcher config `cfg`, read from `uri`."""
    types = cfg.get("available_node_types") if isinstance(cfg, dict) else None
    if not isinstance(types, dict):
        raise DFlashError(
            "not a cluster launcher config: `available_node_types` must map names to node types",
            file=uri,
            field="available_node_types",
        )
    gen = train = 0
    for name, node in types.items():
        where = f"available_node_types.{name}"
        resources = node.get("resources") if isinstance(node, dict) else None
        if not isinstance(resources, dict):
            raise DFlashError("a node type needs a `resources` mapping", file=uri, field=where)
        gpus = _whole(resources.get("GPU", 0), MAX_GPUS_PER_NODE, uri, f"{where}.resources.GPU")
        gpus *= _whole(node.get("max_workers", 0), MAX_WORKERS, uri, f"{where}.max_workers")
        if resources.get("gen_node"):
            gen += gpus
        if resources.get("train_node"):
            train += gpus
    for stage, total in (("gen_node", gen), ("train_node", train)):
        if total > MAX_GPUS:
            raise DFlashError(
                f"the node types with `{stage}` hold {total} GPUs at their max_workers: allowed: <= {MAX_GPUS}",
                file=uri,
            )
    if not gen or not train:
        raise DFlashError("needs node types with `gen_node` and `train_node` resources and GPUs", file=uri)
    return gen, train


def _whole(value: Any, most: int, uri: str, field: str) -> int:
    """`value` as a count of GPUs or nodes: a whole number in [0, most] (8.0 is 8; true, 0.5, .inf are none)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value != int(value):
        raise DFlashError(f"{value!r}: allowed: a whole number in [0, {most}]", file=uri, field=field)
    if not 0 <= value <= most:
        raise DFlashError(
            f"{value!r} is out of range: allowed: a whole number >= 0 and <= {most}", file=uri, field=field
        )
    return int(value)
