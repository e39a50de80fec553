"""`ray`: which cluster a command joins or starts (read by `dflash_ray/cluster.py`), and the custom
resources that place each kind of actor on its node type (cluster.yaml, k8s/rayjob.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ray.settings.fields import at_least


@dataclass(frozen=True, kw_only=True, slots=True)
class RayConfig:
    address: str | None = None  # None: start or join a local cluster
    num_cpus: int | None = at_least(1, default=None)  # only for a local cluster started here
    object_store_memory: int | None = at_least(1, default=None)
    include_dashboard: bool = False
    # node types: custom resources of the nodes each kind of actor must run on; "" (the default, and
    # what a local cluster wants): anywhere. cluster.yaml and k8s/rayjob.yaml give head_node / gen_node /
    # train_node.
    head_resource: str = ""  # the head's: the shard pool and the training coordinator
