"""Where every generation shard is: pending, leased (to which generator, until when) or done.

No Ray here: the pool actor wraps one `ShardLeases`. The rules that make output exactly-once:
- a shard is leased to one generator at a time; a lease that dies with its generator, or sees no
  heartbeat for `lease_timeout_s`, goes back to the front of the queue;
- the first `complete` of a shard wins and is recorded; a later one (a timed-out generator that
  finished after all) is refused, and its files are never listed in the dataset manifest;
- a generator asked to drain gets no new shard; the one it holds finishes normally;
- while paused, no shard is leased: a generator that asks is told to wait (`PAUSED`), its engine
  kept loaded; the shards already leased finish normally.

With `generate.autoscale` on, `reconcile` also revises the target count (`wanted_generators`) from
the queue and the seconds a shard and an engine start have taken in this run; `set_target` from
`dflash-ray scale` turns that off for the rest of the run.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from dflash_ray.config import AutoscaleConfig

PROGRESS = "_progress.json"  # finished shards of a generation, on storage next to its output
PAUSED = "paused"  # `lease`: work is left but leasing is paused; ask again once it resumes


@dataclass(slots=True)
class Lease:
    generator: str
    number: int
    deadline: float
    started: float


RECENT = 8  # the shards whose durations set the autoscaler's rate: the last ones finished


def wanted_generators(
    queued: int, leased: int, alive: int, shard_s: float | None, start_s: float | None, auto: AutoscaleConfig
) -> int | None:
    """Generators to run: enough to clear the queue within `drain_within_s` at `shard_s` seconds a
    shard a generator; none added when those running clear it before a new engine would be up
    (`start_s`), never more than there are shards left; within [min, max]. None before any shard
    has finished (nothing measured: keep the count)."""
    if shard_s is None:
        return None
    work_s = queued * shard_s
    want = math.ceil(work_s / auto.drain_within_s)
    running = max(alive, 1)
    if want > running and start_s is not None and work_s / running <= start_s:
        want = running  # an engine started now would find the queue empty
    want = min(want, queued + leased)
    if queued:
        want = max(want, 1)
    return max(auto.min_generators, min(auto.max_generators, want))


def _generator_order(gid: str) -> tuple[int, str]:
    digits = "".join(ch for ch in gid if ch.isdigit())
    return (int(digits) if digits else 0, gid)


class ShardLeases:
    def __init__(
        self,
        units: list[dict[str, Any]],
        done: dict[int, dict[str, Any]],
        target: int,
        lease_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        paused: bool = False,
        autoscale: AutoscaleConfig | None = None,
    ):
        self.units = {int(u["index"]): u for u in units}
        self.done = {int(k): v for k, v in done.items()}
        self.pending = collections.deque(i for i in sorted(self.units) if i not in self.done)
        self.leased: dict[int, Lease] = {}
        self.target = target
        self.alive: set[str] = set()
        self.draining: set[str] = set()
        self.timeout, self.clock = lease_timeout_s, clock
        self.paused = paused
        self.lease_count = 0
        self.tokens = 0  # generated during this run
        self.prompts_run = 0
        self.first_lease: float | None = None
        self.last_done: float | None = None
        # autoscaling: None when off (or turned off by a manual `set_target`)
        self.auto = autoscale if autoscale is not None and autoscale.enabled else None
        if self.auto:
            self.target = max(self.auto.min_generators, min(self.auto.max_generators, target))
        self.next_revision = 0.0
        self.registered: dict[str, float] = {}  # generator -> when it was started
        self.start_s: list[float] = []  # seconds from start to a generator's first `lease`
        self.shard_s: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.peak = 0  # the most generators alive at once
        self.lost_s = 0.0  # seconds of work on shards whose generator died or timed out (done again)

    # generators
    def register(self, gid: str) -> None:
        self.alive.add(gid)
        self.registered[gid] = self.clock()
        self.peak = max(self.peak, len(self.alive))

    def exited(self, gid: str) -> list[int]:
        """A generator is gone (drained, out of work or dead): its shards go back to the queue."""
        self.alive.discard(gid)
        self.draining.discard(gid)
        back = sorted(i for i, lease in self.leased.items() if lease.generator == gid)
        now = self.clock()
        for i in reversed(back):
            self.lost_s += now - self.leased.pop(i).started
            self.pending.appendleft(i)
        return back

    def set_target(self, n: int, room: int | None = None) -> str | None:
        """A target set by hand (`dflash-ray scale`) turns autoscaling off for the rest of the run.
        It is held to the shards left (a generator more would find no work) and to `room` (the
        generators the cluster can hold, when known); returns what bounded it, if anything."""
        if n < 0:
            raise ValueError(f"generators must be >= 0, got {n}")
        left = len(self.pending) + len(self.leased)
        bounds = [(left, f"{left} shards are left")] + (
            [(room, f"the cluster's nodes hold {room} generators")] if room is not None else []
        )
        low, why = min(bounds)
        self.target = min(n, low)
        self.auto = None
        return f"asked for {n} generators, set to {self.target}: {why}" if n > low else None

    def revise(self) -> None:
        """The autoscaler's step: a new target from the queue and the measured rates, at most once
        every `interval_s`."""
        now = self.clock()
        if self.auto is None or now < self.next_revision:
            return
        shard_s = sum(self.shard_s) / len(self.shard_s) if self.shard_s else None
        start_s = max(self.start_s) if self.start_s else None
        want = wanted_generators(
            len(self.pending), len(self.leased), len(self.alive - self.draining), shard_s, start_s, self.auto
        )
        if want is not None:
            self.target = want
            self.next_revision = now + self.auto.interval_s

    def reconcile(self) -> tuple[int, list[str]]:
        """(generators to start, generators newly asked to drain) to meet the target."""
        self.revise()
        active = sorted(self.alive - self.draining, key=_generator_order)
        drain = active[self.target :] if len(active) > self.target else []
        self.draining.update(drain)
        start = max(0, min(self.target - len(active), len(self.pending)))
        return start, drain

    # shards
    def lease(self, gid: str) -> dict[str, Any] | str | None:
        """A shard for `gid`; None when it should stop (draining, gone, or no work left); `PAUSED`."""
        self.expire()
        if gid in self.registered:  # its first ask: the engine is up
            self.start_s.append(self.clock() - self.registered.pop(gid))
        if gid in self.draining or gid not in self.alive or not self.pending:
            return None
        if self.paused:
            return PAUSED
        index = self.pending.popleft()
        self.lease_count += 1
        now = self.clock()
        self.leased[index] = Lease(gid, self.lease_count, now + self.timeout, now)
        self.first_lease = self.first_lease or now
        return {**self.units[index], "lease": self.lease_count}

    def heartbeat(self, gid: str) -> None:
        deadline = self.clock() + self.timeout
        for lease in self.leased.values():
            if lease.generator == gid:
                lease.deadline = deadline

    def expire(self) -> list[str]:
        """Leases past their deadline go back to the queue; returns their generators (to replace)."""
        now = self.clock()
        late = sorted((i for i, lease in self.leased.items() if lease.deadline < now), reverse=True)
        gens = [self.leased[i].generator for i in late]
        for i in late:
            self.lost_s += now - self.leased.pop(i).started
            self.pending.appendleft(i)
        return sorted(set(gens))

    def complete(self, gid: str, index: int, entry: dict[str, Any]) -> bool:
        """Record a finished shard; False when it was already done (the caller's files are dropped)."""
        if index in self.done:
            return False
        self.done[index] = entry
        lease = self.leased.get(index)
        if lease is not None:
            del self.leased[index]
            if lease.generator == gid:
                self.shard_s.append(self.clock() - lease.started)
        if index in self.pending:  # expired and queued again, then finished by its first holder
            self.pending.remove(index)
        self.tokens += int(entry.get("output_tokens", 0))
        self.prompts_run += int(entry.get("prompts", 0))
        self.last_done = self.clock()
        return True

    @property
    def finished(self) -> bool:
        return not self.pending and not self.leased

    def status(self) -> dict[str, Any]:
        total = sum(int(u["count"]) for u in self.units.values())
        done = sum(int(self.units[i]["count"]) for i in self.done)
        elapsed = (self.last_done or 0) - (self.first_lease or 0) if self.first_lease and self.last_done else 0
        rate = self.prompts_run / elapsed if elapsed > 0 else None
        return {
            "shards_total": len(self.units),
            "shards_done": len(self.done),
            "shards_leased": len(self.leased),
            "queue_depth": len(self.pending),
            "prompts_total": total,
            "prompts_done": done,
            "generators_target": self.target,
            "generators_alive": len(self.alive),
            "generators_draining": len(self.draining),
            "generators": sorted(self.alive, key=_generator_order),
            "generators_peak": self.peak,
            "autoscale": self.auto is not None,
            "leased_by": {
                g: sorted(i for i, lease in self.leased.items() if lease.generator == g)
                for g in sorted({lease.generator for lease in self.leased.values()})
            },
            "done_by": dict(collections.Counter(str(e.get("generator")) for e in self.done.values())),
            "paused": self.paused,
            "tokens_generated": self.tokens,
            "tokens_per_s": round(self.tokens / elapsed, 2) if elapsed > 0 else None,
            "eta_s": round((total - done) / rate, 1) if rate else None,
            "finished": self.finished,
            "seconds_lost": round(self.lost_s, 1),
        }
