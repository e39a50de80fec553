"""Every environment variable of dflash-ray's own that takes a number, declared once with its range.

These settings belong to a node (its network, the store's limits), not to a run, so they come from
the environment rather than the run config. Each is read through `number`, which refuses a value out
of its declared range naming the variable; the CLI checks them all (`check_all`) before a command
starts anything, so a bad one is named at once, not inside a Ray worker's traceback.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from dflash_ray.errors import DFlashError


@dataclass(frozen=True)
class Variable:
    default: float
    low: float
    high: float
    whole: bool
    unit: str
    meaning: str

    def allowed(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        return f"{kind} of {self.unit} in [{self.low:g}, {self.high:g}]"


VARIABLES: dict[str, Variable] = {
    "AWS_MAX_ATTEMPTS": Variable(8, 1, 100, True, "tries", "tries of one S3 request (botocore's standard retries)"),
    "DFLASH_RAY_S3_CONNECT_TIMEOUT_S": Variable(10.0, 0.1, 3600, False, "seconds", "connecting to S3, per try"),
    "DFLASH_RAY_S3_READ_TIMEOUT_S": Variable(10.0, 0.1, 3600, False, "seconds", "each read of an S3 answer"),
    "DFLASH_RAY_S3_CONCURRENCY": Variable(16, 1, 1024, True, "requests", "ranged GETs at once in a model fetch"),
    # from 16 KiB (a file in many thousand ranges) to S3's largest part
    "DFLASH_RAY_S3_CHUNK_MB": Variable(64.0, 1 / 64, 5120, False, "MiB", "what one ranged GET of a fetch asks for"),
}


def number(name: str) -> float:
    """The variable's value from the environment (its default when unset), in its declared range."""
    var = VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return var.default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not var.low <= value <= var.high or (var.whole and value != int(value)):
        raise DFlashError(f"{raw!r}: allowed: {var.allowed()} ({var.meaning})", field=f"{name} (environment)")
    return int(value) if var.whole else value


def check_all() -> None:
    """Refuse any declared variable set out of its range, naming it (before a command starts)."""
    for name in VARIABLES:
        number(name)
