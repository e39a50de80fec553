"""A deadline on every wait of the coordinator. Ray says at once when an actor dies (its pending
calls raise `RayActorError`), but a rank alive and stuck (a stalled read, a hung kernel) with no
send pending has no watchdog anywhere: without a deadline its stream's GPUs, and every other
stream's in the next collective, idle until a person notices. A wait here ends after
`train.deadline_floor_s` + `train.deadline_factor` x the median of the last steps' seconds (what
the run has shown a step takes), and raises `Stalled` naming the actors that missed it, which the
coordinator treats as a failure: it restarts the run from its checkpoint. Work whose length the
floor cannot bound (a start-up fetching 54 GB, a warm-up compiling dozens of graphs) tells its
progress instead (`dflash_ray.progress`), each actor its own: each has its own deadline, moved only
by its own count, so one that stops is named (with its node and what it was doing) a floor after
its last progress, even while the others still move.
"""

from __future__ import annotations

import collections
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

from dflash_ray import progress
from dflash_ray.progress import Told

log = logging.getLogger(__name__)

RECENT = 20  # steps the expected step time is measured over
PROGRESS_LOOK_S = 1.0  # how often a wait on work that tells its progress looks at it
LOG_EVERY_S = 60.0  # how often such a wait logs the progress of all its actors together
EVERY = ""  # the progress key of actors that cannot be told apart: the job's sum is their progress
ANSWER = "did not answer within {:.0f} s (train.deadline_floor_s + train.deadline_factor x the recent step time)"


class Stalled(RuntimeError):
    """Actors that missed a deadline: alive, but stuck. `why[i]`: how `late[i]` missed it; `where`:
    an actor's node and what it was doing, where it told."""

    def __init__(self, what: str, late: list[str], why: list[str], where: dict[str, str] | None = None):
        self.late, self.where = late, where or {}
        named: dict[str, list[str]] = {}  # the actors, by how they missed it
        for name, reason in zip(late, why):
            named.setdefault(reason, []).append(f"{name} ({self.where[name]})" if name in self.where else name)
        said = "; ".join(f"{', '.join(names)} {reason}" for reason, names in named.items())
        super().__init__(f"{what}: {said}: alive but stuck; restarting from the checkpoint")


@dataclass
class _Actor:
    """What a wait on work that tells its progress knows of one actor's: its last reading, and
    when it is late unless that reading moves."""

    reading: tuple[int, str] | None
    deadline: float
    moved: bool = False


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

    def miss(
        self,
        what: str,
        late: list[str],
        limit_s: float,
        why: list[str] | None = None,
        where: dict[str, str] | None = None,
    ) -> None:
        """`late` missed the deadline `limit_s` of `what` (how, each: `why`; default: no answer in
        time): recorded, logged and raised (`Stalled`)."""
        err = Stalled(what, late, why or [ANSWER.format(limit_s)] * len(late), where)
        record = {"what": what, "late": late, "limit_s": round(limit_s, 1), "at": time.time()}
        self.missed.append({**record, "where": err.where} if err.where else record)
        log.error("%s", err)
        raise err

    def wait(self, refs: list, names: list[str], what: str, limit_s: float | None = None, watch=None) -> list:
        """The results of `refs` (the calls of the actors `names`, in order). An error is raised as
        soon as it is known (the other ranks may be waiting for the failed one in a collective), and
        so is one of `watch` (calls in flight that are not waited for: a target's batch ahead, whose
        death would otherwise be seen only at its turn); past the deadline, `Stalled` names the
        actors whose calls have not returned."""
        limit_s = self.limit() if limit_s is None else limit_s
        deadline = time.monotonic() + limit_s
        pending, watched = list(refs), list(watch or [])
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self.miss(what, sorted({names[i] for i, r in enumerate(refs) if r in pending}), limit_s)
            _take(pending, watched, left)
        return _results(refs)

    def wait_progressing(
        self,
        refs: list,
        names: list[str],
        what: str,
        first_s: float,
        keys: list[str] | None = None,
        nodes: list[str] | None = None,
    ) -> list:
        """A wait on work that says how far it is (`dflash_ray.progress`: a start-up's weight bytes,
        a warm-up's shapes). Each actor has its own deadline: `first_s` for it to begin moving
        (processes start, imports), then as long as its own count moves, ending
        `train.deadline_floor_s` after it last moved. A slow start is never cut off; a stuck actor
        is, even while the others still move, and the error says where it was and what it was
        doing. `keys`: each call's actor's progress key (its Ray actor name); None: the actors
        cannot be told apart, and the job's sum moves them all. `nodes`: where each was placed, for
        an actor that never told."""
        keys = keys or [EVERY] * len(refs)
        told = progress.told()
        start = time.monotonic()
        actors = {k: _Actor(_reading(k, told), start + first_s) for k in keys}
        pending = list(refs)
        logged = start
        while pending:
            now, told = time.monotonic(), progress.told()
            for key, actor in actors.items():
                if (reading := _reading(key, told)) != actor.reading:  # it moved: its deadline moves with it
                    actor.reading, actor.deadline, actor.moved = reading, now + self.floor_s, True
            waiting = [i for i, r in enumerate(refs) if r in pending]
            late = [i for i in waiting if actors[keys[i]].deadline <= now]
            if late:
                self._missed_progress(what, late, names, keys, nodes, actors, told, first_s)
            if now - logged >= LOG_EVERY_S:
                logged = now
                log.info(
                    "%s: %d of %d actors at work, %d units told in all", what, len(waiting), len(refs), progress.seen()
                )
            left = min(actors[keys[i]].deadline for i in waiting) - now
            _take(pending, [], min(left, PROGRESS_LOOK_S))
        return _results(refs)

    def _missed_progress(
        self,
        what: str,
        late: list[int],
        names: list[str],
        keys: list[str],
        nodes: list[str] | None,
        actors: dict[str, _Actor],
        told: dict[str, Told],
        first_s: float,
    ) -> None:
        """The actors of calls `late` are past their deadlines: named, each with its node, what it
        was doing and how long it went without progress."""
        why, where = [], {}
        for i in late:
            moved = actors[keys[i]].moved
            why.append(
                f"made no progress for {self.floor_s:.0f} s (train.deadline_floor_s)"
                if moved
                else f"told no progress within {first_s:.0f} s of the wait's start"
            )
            entry = told.get(keys[i]) if keys[i] != EVERY else None
            if entry is not None:
                where[names[i]] = f"node {entry.node}, {entry.stage or 'at work'}"
            elif nodes:
                where[names[i]] = f"node {nodes[i]}" + (", told nothing yet" if keys[i] != EVERY else "")
        limit_s = max(self.floor_s if actors[keys[i]].moved else first_s for i in late)
        self.miss(what, [names[i] for i in late], limit_s, why, where)


def _reading(key: str, told: dict[str, Told]) -> tuple[int, str] | None:
    """An actor's progress as it stands: its count and stage (None: it has told nothing). One that
    waits on work its node shares moves with its node; `EVERY` is the job's sum."""
    if key == EVERY:
        return sum(t.units for t in told.values()), ""
    entry = told.get(key)
    if entry is None:
        return None
    count = entry.units
    if entry.waits:
        count += sum(t.units for k, t in told.items() if t.node == entry.node and k != key)
    return count, entry.stage


def _take(pending: list, watched: list, timeout: float) -> None:
    """Wait up to `timeout` for one of `pending` or `watched` to end, and drop it from its list;
    an error (or an actor's death) is raised."""
    import ray

    ready, _ = ray.wait(pending + watched, num_returns=1, timeout=max(0.0, timeout))
    for ref in ready:
        (watched if ref in watched else pending).remove(ref)
        ray.get(ref)


def _results(refs: list) -> list:
    import ray

    return ray.get(refs)
