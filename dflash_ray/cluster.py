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
        check_reachable(address, "ray.address" if cfg.address else "the environment's RAY_ADDRESS")
        ray.init(address=address, log_to_driver=True)
        return
    if existing:
        try:
            ray.init(address="auto", log_to_driver=False)
        except ConnectionError:
            raise DFlashError(
                "no Ray cluster is running here; set ray.address or RAY_ADDRESS", field="ray.address"
            ) from None
        return
    start_local(
        num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory, include_dashboard=cfg.include_dashboard
    )


def check_reachable(address: str, setting: str, within_s: float = 20.0) -> None:
    """Refuse an address nothing answers at, within `within_s`, naming where it came from: Ray's own
    connection retries the GCS for minutes before it says anything."""
    import socket
    import time
    from urllib.parse import urlsplit

    if address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise DFlashError(
            f"{address!r} (from {setting}) is not an address: allowed: HOST:PORT, ray://HOST:PORT, or auto"
        )
    deadline, error = time.monotonic() + within_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, within_s)):
                return
        except OSError as e:
            error = e
            time.sleep(1.0)  # a head that is still starting: a few more tries
    raise DFlashError(
        f"no Ray cluster answers at {address} (from {setting}) after {within_s:g} s: {error}; "
        "start the head, fix the address, or unset it to start a local cluster"
    )


def on_node(resource: str) -> dict[str, float]:
    """The `resources` option that keeps an actor on nodes of one type (those that offer `resource`,
    a custom resource of the node type): a token amount, so any number of actors fit; none for ""."""
    return {resource: 0.001} if resource else {}


LOCAL_ADDRESS = "127.0.0.1"


def start_local(**init_args) -> None:
    """Start a one-machine cluster for this process alone, on the loopback address: its GCS, raylet,
    workers and agents listen on 127.0.0.1, never on the machine's other interfaces.

    Ray 2.60 turns a loopback `_node_ip_address` into the machine's outward address unless
    multi-node clusters are off (its default on macOS and Windows, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`);
    they are turned off for the start alone, so the node takes 127.0.0.1 as given.
    """
    import ray
    from ray._private import ray_constants

    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        # "local": a new cluster even when `ray start` left one on this machine (ray.init would join it)
        ray.init(address="local", _node_ip_address=LOCAL_ADDRESS, **init_args)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node
