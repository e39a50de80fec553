"""Joining or starting the Ray cluster a stage runs on."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from dflash_ray.config import RayConfig
from dflash_ray.errors import DFlashError, keep_catching_sigterm, signals_held

log = logging.getLogger(__name__)


def connect(cfg: RayConfig, *, existing: bool = False, holds: Callable[[], bool] | None = None) -> None:
    """Join the cluster named by config or `RAY_ADDRESS` (as under `ray job submit`), else start a
    local one (`existing`: else join one running on this machine, `holds`: the first where it says
    yes; see `join_running`). A driver that already called `ray.init` keeps its cluster. Ctrl-C or
    SIGTERM during the start stop the command once Ray is up (`signals_held`)."""
    import ray

    if ray.is_initialized():
        return
    with signals_held():
        _connect(cfg, existing, holds)


def _connect(cfg: RayConfig, existing: bool, holds: Callable[[], bool] | None) -> None:
    import ray

    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        setting = "ray.address" if cfg.address else "the environment's RAY_ADDRESS"
        check_reachable(address, setting)
        with _refusals(address, setting):
            ray.init(address=address, log_to_driver=True)
        keep_catching_sigterm()  # ray.init installs its own SIGTERM handler, which exits at once
        return
    if existing:
        looked = join_running(holds)
        if not looked:
            raise DFlashError("no Ray cluster is running here; set ray.address or RAY_ADDRESS", field="ray.address")
        keep_catching_sigterm()
        return
    start_local(
        num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_memory, include_dashboard=cfg.include_dashboard
    )
    keep_catching_sigterm()


def join_running(holds: Callable[[], bool] | None = None, within_s: float = 5.0) -> list[str]:
    """Join a cluster running on this machine: those the local starts recorded (`start_local`,
    newest first), then the one Ray itself finds (`ray start`'s). With `holds`, each is joined in
    turn until `holds()` says yes; without, the first that answers. Returns the addresses looked at,
    connected to the last of them when it holds (or no `holds` was given), to none otherwise. Every
    wait is bounded: an address that takes no connection within `within_s` is passed over. A
    cluster that refuses the join is passed over too, and its refusal raised when none holds."""
    import ray

    looked: list[str] = []
    refused: DFlashError | None = None
    candidates = [(r["address"], r.get("auth")) for r in local_clusters()]
    found = _ray_found()
    if found is not None and found not in [a for a, _ in candidates]:
        candidates.append((found, None))
    for address, auth in candidates:
        if not _answers(address, within_s):
            continue
        try:
            with _refusals(address, "the clusters running on this machine"):
                if _is_loopback(address):
                    _join_loopback(address, auth)
                else:
                    ray.init(address=address, log_to_driver=False)
        except DFlashError as e:
            refused = refused or e
            continue
        looked.append(address)
        if holds is None or holds():
            return looked
        ray.shutdown()
    if refused is not None:
        raise refused
    return looked


@contextlib.contextmanager
def _refusals(address: str, setting: str) -> Iterator[None]:
    """A join that Ray refuses, said in one line naming the address and where it came from: a
    service at it that is no Ray head (ConnectionError), or a cluster that wants a token this
    process does not hold (AuthenticationError)."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as e:
        reason = (getattr(e, "message", "") or "authentication failed").strip().splitlines()[0]
        raise DFlashError(
            f"the Ray cluster at {address} (from {setting}) refused the join: {reason}; a cluster started "
            "with token authentication takes RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, or "
            "~/.ray/auth_token), or set ray.address (or RAY_ADDRESS) to another cluster"
        ) from None
    except ConnectionError as e:
        reason = (str(e).strip().splitlines() or ["no answer"])[0]
        raise DFlashError(
            f"no Ray cluster joined at {address} (from {setting}): {reason}; what answers there is not a "
            "Ray head, or not yet: set ray.address (or RAY_ADDRESS) to a head's address (HOST:6379, or "
            "ray://HOST:10001), or unset it to start a local cluster"
        ) from None


def _ray_found() -> str | None:
    """The cluster `ray.init(address="auto")` would join: `ray start`'s recorded address, else any GCS
    Ray finds running here; None when there is none."""
    from ray._private import services

    try:
        return services.get_ray_address_from_environment("auto", None)
    except ConnectionError:
        return None


def _answers(address: str, within_s: float) -> bool:
    import socket

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=within_s):
            return True
    except (OSError, ValueError):
        return False


def _is_loopback(address: str) -> bool:
    import ipaddress

    host = address.rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _join_loopback(address: str, auth: str | None) -> None:
    """Join a cluster listening on the loopback address as a driver on it: Ray would otherwise turn
    127.0.0.1 into the machine's outward address and wait for a GCS there without end (the same
    switch as `start_local`). A cluster Ray started with token authentication is joined with the
    token Ray saved for it, as its own "auto" does."""
    import ray
    from ray._private import ray_constants

    if auth == "token":
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address=address, _node_ip_address=LOCAL_ADDRESS, log_to_driver=False)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node


def check_reachable(address: str, setting: str, within_s: float = 20.0) -> None:
    """Refuse an address nothing answers at, within `within_s`, naming where it came from: Ray's own
    connection retries the GCS for minutes before it says anything."""
    import socket
    import time
    from urllib.parse import urlsplit

    if address in ("auto", "local"):
        return
    try:
        parts = urlsplit(address if "://" in address else f"gcs://{address}")
        host, port = parts.hostname, parts.port
    except ValueError:  # "http://[::1": no closing bracket; a port past 65535
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
    workers and agents listen on 127.0.0.1, never on the machine's other interfaces. Its address is
    recorded (`local_clusters`) while this process runs, so that `status`, `scale`, `pause` and
    `resume` on this machine find it.

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
    _record(ray.get_runtime_context().gcs_address)


def records_dir() -> Path:
    """Where the local starts of this user record their clusters' addresses, one file a process."""
    return Path(tempfile.gettempdir()) / f"dflash-ray-{os.getuid()}" / "clusters"


def _record(address: str) -> None:
    folder = records_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = folder / f"{os.getpid()}.json"
        body = {"address": address, "pid": os.getpid(), "started": time.time()}
        body["auth"] = os.environ.get("RAY_AUTH_MODE")  # "token": Ray turned its token authentication on
        path.write_text(json.dumps(body))
    except OSError as e:  # only the control commands lose: the run itself goes on
        log.warning("could not record the local cluster's address (%s): status and scale will not find it", e)
        return
    atexit.register(lambda: path.unlink(missing_ok=True))


def local_clusters() -> list[dict]:
    """The local clusters recorded by processes that still run, newest first (a record of a process
    that is gone is removed)."""
    found = []
    for path in records_dir().glob("*.json"):
        try:
            record = json.loads(path.read_text())
            os.kill(int(record["pid"]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found.append(record)
    return sorted(found, key=lambda r: -float(r.get("started", 0)))
