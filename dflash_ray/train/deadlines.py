"""A deadline on every wait of the coordinator. Ray says at once when an actor dies (its pending
calls raise `RayActorError`), but a rank alive and stuck (a stalled read, a hung kernel) with no
send pending has no watchdog anywhere: without a deadline its stream's GPUs, and every other
stream's in the next collective, idle until a person notices. A wait here ends after
`train.deadline_floor_s` + `train.deadline_factor` x the median of the last steps' seconds (what
the run has shown a step takes), and raises `Stalled` naming the actors that missed it, which the
coordinator treats as a failure: it restarts the run from its checkpoint.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from typing import Any

log = logging.getLogger(__name__)

RECENT = 20  # steps the expected step time is measured over


class Stalled(RuntimeError):
    """Actors that missed a deadline: alive, but stuck."""

    def __init__(self, what: str, late: list[str], limit_s: float):
        self.late = late
        super().__init__(
            f"{what}: {', '.join(late)} did not answer within {limit_s:.0f} s (train.deadline_floor_s + "
            "train.deadline_factor x the recent step time): alive but stuck; restarting from the checkpoint"
        )


class Deadlines:
    """The expected step time (from the last steps) and the waits bounded by it."""

    def __init__(self, floor_s: float, factor: float):
        self.floor_s, self.factor = floor_s, factor
        self.recent: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.missed: list[dict[str, Any]] = []  # every deadline missed: what, who, when

    def observe(self, step_s: float) -> None:
        self.recent.append(step_s)

    def limit(self, steps: float = 1.0) -> float:
        """Seconds a wait of `steps` steps' work may take; the floor alone before any step was timed."""
        expected = statistics.median(self.recent) if self.recent else 0.0
        return self.floor_s + self.factor * expected * steps

    def miss(self, what: str, late: list[str], limit_s: float) -> None:
        """`late` missed the deadline of `what`: recorded, logged and raised (`Stalled`)."""
        self.missed.append({"what": what, "late": late, "limit_s": round(limit_s, 1), "at": time.time()})
        log.error("%s: %s missed the deadline of %.0f s", what, ", ".join(late), limit_s)
        raise Stalled(what, late, limit_s)

    def wait(
        self,
        refs: list,
        names: list[str],
        what: str,
        limit_s: float | None = None,
        watch: list | None = None,
    ) -> list:
        """The results of `refs` (the calls of the actors `names`, in order). An error is raised as
        soon as it is known (the other ranks may be waiting for the failed one in a collective), and
        so is one of `watch` (calls in flight that are not waited for: a target's batch ahead, whose
        death would otherwise be seen only at its turn); past the deadline, `Stalled` names the
        actors whose calls have not returned."""
        import ray

        limit_s = self.limit() if limit_s is None else limit_s
        deadline = time.monotonic() + limit_s
        pending = list(refs)
        watched = list(watch or [])
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.miss(what, sorted({names[i] for i, r in enumerate(refs) if r in pending}), limit_s)
            ready, _ = ray.wait(pending + watched, num_returns=1, timeout=left)
            for ref in ready:
                if ref in watched:
                    watched.remove(ref)
                else:
                    pending.remove(ref)
                ray.get(ref)  # raises the actor's error, or its death
        return ray.get(refs)
