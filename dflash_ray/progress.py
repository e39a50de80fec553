"""Work that is under way, told to whoever waits on it: a stream actor's start-up (weight bytes
fetched, or read from the node's disk) and warm-up (graph shapes met) run inside calls the
coordinator cannot look into, and a fixed deadline on them cannot tell a slow start from a stuck one.
Each piece of work adds to its process's counter here, and says what it is (`doing`); inside a Ray
job the counter is published (at most once a second, and at once when the stage changes) to the
cluster's key-value store under the job's id and the process's name: its Ray actor's name, or
host-pid. The coordinator reads each actor's count on its own (`told`: a wait gives every actor
its own deadline, so one stuck actor is named even while the others move, `train/deadlines.py`)
and their sum for the log (`seen`). A process waiting for work its node shares (one copy of a
target fetched for every actor of the node, `node_shared`) says so, and moves while its node does.
Outside Ray, `add` only counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Iterator, NamedTuple

PUBLISH_EVERY_S = 1.0
_PREFIX = "dflash-progress"
_lock = threading.Lock()
_count = [0]  # units done in this process
_published = [0.0]  # when they were last published (monotonic seconds)
_doing: list[tuple[str, bool]] = [("", False)]  # what this process does now; whether it waits on its node
_me: dict[str, tuple[str, str]] = {}  # job prefix -> (this process's key, its node's address)


class Told(NamedTuple):
    """One process's published progress: its units done, what it was doing, its node's address, and
    whether it waits on work its node shares (then its node's counts are its progress too)."""

    units: int
    stage: str
    node: str
    waits: bool = False


def _key_prefix() -> str | None:
    """This Ray job's prefix in the key-value store, or None outside a Ray worker or driver."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return f"{_PREFIX}/{ray.get_runtime_context().get_job_id()}/"


def _identity(prefix: str) -> tuple[str, str]:
    """This process's key under `prefix` (its actor's name, which the coordinator knows, or
    host-pid) and its node's address."""
    if prefix not in _me:
        import ray

        name = ray.get_runtime_context().get_actor_name() or f"{socket.gethostname()}-{os.getpid()}"
        _me[prefix] = (prefix + name, ray.util.get_node_ip_address())
    return _me[prefix]


def add(units: int = 1) -> None:
    """Count `units` of work done in this process (bytes, shapes); published within a second."""
    with _lock:
        _count[0] += units
        due = time.monotonic() - _published[0] >= PUBLISH_EVERY_S
        if due:
            _published[0] = time.monotonic()
    if due:
        publish()


@contextlib.contextmanager
def doing(stage: str, waits: bool = False) -> Iterator[None]:
    """Within the block this process is doing `stage` (told at once, and in the error of a wait it
    misses); `waits`: waiting on work its node shares. The stage before comes back after it."""
    with _lock:
        before, _doing[0] = _doing[0], (stage, waits)
    publish()
    try:
        yield
    finally:
        with _lock:
            _doing[0] = before
        publish()


@contextlib.contextmanager
def node_shared(lock: Any, stage: str) -> Iterator[None]:
    """Hold `lock` (one process of a node at a time: a file lock) while doing `stage` for the whole
    node. While another process holds it, this one waits on it, and its node's progress is its own:
    the actors that wait for a node's one copy are not taken for stuck."""
    with doing(f"waiting while another process of its node is {stage}", waits=True):
        lock.acquire()
    try:
        with doing(stage):
            yield
    finally:
        lock.release()


def watched() -> bool:
    """Whether this process's progress is published (inside Ray): only then is counting work worth
    any cost of its own."""
    return _key_prefix() is not None


def publish() -> None:
    """Put this process's count and stage in the job's key-value store now (a no-op outside Ray)."""
    prefix = _key_prefix()
    if prefix is None:
        return
    from ray.experimental import internal_kv

    key, node = _identity(prefix)
    with _lock:
        (stage, waits), count = _doing[0], _count[0]
    value = json.dumps({"count": count, "stage": stage, "node": node, "waits": waits})
    internal_kv._internal_kv_put(key, value.encode(), overwrite=True)


def told() -> dict[str, Told]:
    """Every process's published progress in this Ray job, by its name (an actor's name, or
    host-pid): what a wait gives each actor its own deadline by."""
    prefix = _key_prefix()
    if prefix is None:
        stage, waits = _doing[0]
        return {"": Told(_count[0], stage, socket.gethostname(), waits)}
    from ray.experimental import internal_kv

    found = {}
    for key in internal_kv._internal_kv_list(prefix):
        value = internal_kv._internal_kv_get(key)
        if value:
            entry = json.loads(value)
            name = (key.decode() if isinstance(key, bytes) else key)[len(prefix) :]
            found[name] = Told(int(entry["count"]), entry["stage"], entry["node"], bool(entry["waits"]))
    return found


def seen() -> int:
    """The sum of every process's published count in this Ray job: it moves while any work does."""
    return sum(t.units for t in told().values())


def forget(names: list[str]) -> None:
    """Drop the published progress of the processes `names` (actors about to start again under the
    same names: what their last attempt told is not theirs)."""
    prefix = _key_prefix()
    if prefix is None:
        return
    from ray.experimental import internal_kv

    for name in names:
        internal_kv._internal_kv_del(prefix + name)
