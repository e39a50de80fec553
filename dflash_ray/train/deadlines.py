"""A deadline on every wait of the coordinator. Ray says at once when an actor dies (its pending
calls raise `RayActorError`), but a rank alive and stuck (a stalled read, a hung kernel) with no
send pending has no watchdog anywhere: without a deadline its stream's GPUs, and every other
stream's in the next collective, idle until a person notices. A wait here ends after
`train.deadline_floor_s` + `train.deadline_factor` x the median of the last steps' seconds (what
the run has shown a step takes), and raises `Stalled` naming the actors that missed it, which the
coordinator treats as a failure: it restarts the run from its checkpoint. Work whose length the
floor cannot bound (a start-up fetching 54 GB, a warm-up compiling dozens of graphs) tells its
progress instead (`dflash_ray.progress`), and its wait ends only once it stops moving for the floor.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

RECENT = 20  # steps the expected step time is measured over
PROGRESS_LOOK_S = 1.0  # how often a wait on work that tells its progress looks at it


class Stalled(RuntimeError):
    """Actors that missed a deadline: alive, but stuck."""

    def __init__(self, what: str, late: list[str], limit_s: float, progressing: bool = False):
        self.late = late
        why = (
            f"made no progress for {limit_s:.0f} s (train.deadline_floor_s)"
            if progressing
            else f"did not answer within {limit_s:.0f} s (train.deadline_floor_s + train.deadline_factor x the "
            "recent step time)"
        )
        super().__init__(f"{what}: {', '.join(late)} {why}: alive but stuck; restarting from the checkpoint")


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

    def miss(self, what: str, late: list[str], limit_s: float, progressing: bool = False) -> None:
        """`late` missed the deadline of `what`: recorded, logged and raised (`Stalled`)."""
        self.missed.append({"what": what, "late": late, "limit_s": round(limit_s, 1), "at": time.time()})
        how = "made no progress for" if progressing else "missed the deadline of"
        log.error("%s: %s %s %.0f s", what, ", ".join(late), how, limit_s)
        raise Stalled(what, late, limit_s, progressing)

    def wait_progressing(self, refs: list, names: list[str], what: str, first_s: float) -> list:
        """A wait on work that says how far it is (`dflash_ray.progress`: a start-up's weight bytes, a
        warm-up's shapes): `first_s` for it to begin moving (processes start, imports), then as long
        as it moves, ending `train.deadline_floor_s` after it last moved. A slow start is never cut
        off; a stuck one still is, and the log says which."""
        from dflash_ray import progress

        return self.wait(refs, names, what, self.floor_s, progress=progress.seen, first_s=first_s)

    def wait(
        self,
        refs: list,
        names: list[str],
        what: str,
        limit_s: float | None = None,
        watch: list | None = None,
        progress: Callable[[], int] | None = None,
        first_s: float | None = None,
    ) -> list:
        """The results of `refs` (the calls of the actors `names`, in order). An error is raised as
        soon as it is known (the other ranks may be waiting for the failed one in a collective), and
        so is one of `watch` (calls in flight that are not waited for: a target's batch ahead, whose
        death would otherwise be seen only at its turn); past the deadline, `Stalled` names the
        actors whose calls have not returned. With `progress` (a count that moves while the work
        does), the deadline is `limit_s` past the last time the count moved, looked at every
        `PROGRESS_LOOK_S` at most, and `first_s` (default `limit_s`) before it first moves."""
        import ray

        limit_s = self.limit() if limit_s is None else limit_s
        deadline = time.monotonic() + (limit_s if first_s is None else first_s)
        pending = list(refs)
        watched = list(watch or [])
        seen = first_seen = progress() if progress else None
        while pending:
            now = time.monotonic()
            if progress is not None and (count := progress()) != seen:
                seen, deadline = count, now + limit_s  # the work moved: the deadline moves with it
            left = deadline - now
            if left <= 0:
                late = sorted({names[i] for i, r in enumerate(refs) if r in pending})
                moved = progress is not None and seen != first_seen
                self.miss(what, late, limit_s if first_s is None or moved else first_s, moved)
            look = min(left, PROGRESS_LOOK_S) if progress is not None else left
            ready, _ = ray.wait(pending + watched, num_returns=1, timeout=look)
            for ref in ready:
                if ref in watched:
                    watched.remove(ref)
                else:
                    pending.remove(ref)
                ray.get(ref)  # raises the actor's error, or its death
        return ray.get(refs)
