"""Work that is under way, told to whoever waits on it: a stream actor's start-up (weight bytes
arriving) and warm-up (graph shapes met) run inside calls the coordinator cannot look into, and a
fixed deadline on them cannot tell a slow start from a stuck one. Each piece of work adds to a
counter here; inside a Ray job the counters are published (at most once a second a process) to the
cluster's key-value store under the job's id, and `seen()` on the coordinator sums them: a wait
whose sum still moves is making progress (`train/deadlines.py`). Outside Ray, `add` only counts.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

PUBLISH_EVERY_S = 1.0
_PREFIX = "dflash-progress"
_lock = threading.Lock()
_count = [0]  # units done in this process
_published = [0.0]  # when they were last published (monotonic seconds)


def _key_prefix() -> str | None:
    """This Ray job's prefix in the key-value store, or None outside a Ray worker or driver."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return f"{_PREFIX}/{ray.get_runtime_context().get_job_id()}/"


def add(units: int = 1) -> None:
    """Count `units` of work done in this process (bytes, shapes); published within a second."""
    with _lock:
        _count[0] += units
        due = time.monotonic() - _published[0] >= PUBLISH_EVERY_S
        if due:
            _published[0] = time.monotonic()
        done = _count[0]
    if due:
        publish(done)


def publish(done: int | None = None) -> None:
    """Put this process's count in the job's key-value store now (a no-op outside Ray)."""
    prefix = _key_prefix()
    if prefix is None:
        return
    from ray.experimental import internal_kv

    value = str(_count[0] if done is None else done).encode()
    internal_kv._internal_kv_put(f"{prefix}{socket.gethostname()}-{os.getpid()}", value, overwrite=True)


def seen() -> int:
    """The sum of every process's published count in this Ray job: it moves while any work does."""
    prefix = _key_prefix()
    if prefix is None:
        return _count[0]
    from ray.experimental import internal_kv

    total = 0
    for key in internal_kv._internal_kv_list(prefix):
        value = internal_kv._internal_kv_get(key)
        total += int(value) if value else 0
    return total
