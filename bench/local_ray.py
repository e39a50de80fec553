"""The local Ray cluster of a benchmark that starts actors itself."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def local_ray(**init_args) -> Iterator[None]:
    """Ray started with `init_args` and shut down on the way out; or, when the caller already runs
    one (a test session's cluster), that one as it is, left running: a second `ray.init` in one
    process fails, and shutting the caller's down would strand its other users."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(include_dashboard=False, log_to_driver=False, **init_args)
    try:
        yield
    finally:
        ray.shutdown()
