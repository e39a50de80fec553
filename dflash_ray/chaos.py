"""Fault injection for drills: kill actors (and a node) of a running job at seeded moments, to prove
that the run recovers and loses and repeats nothing.

`chaos.faults` lists what to kill, one fault per entry: `generator`, `tokenize`, `target`,
`drafter` (a worker process killed with SIGKILL, as the OOM killer or a crash would), or `node`
(the raylet of a worker node that runs some of the job's actors: the node and every process on
it are lost). Each fault fires at a seeded moment within `chaos.within_s` seconds (`KIND@SECONDS`:
within that many) after its victims first show up, on a seeded choice among them; a stage that
ends first leaves it not fired. A fault's victims are actors that were not there when an earlier
fault fired: those may be the ones its recovery is tearing down, and a kill there would cost no
recovery of its own. The signal is sent by a task pinned to the victim's node, so it works on a real
cluster too.

No stage knows about this module: it watches the cluster from a thread in the driver.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash_ray.config import ChaosConfig

from dflash_ray.config import FAULT_KINDS, parse_faults

# a fault's kind -> what the actor class names of its victims contain
VICTIMS = {
    "generator": ("Generator",),
    "tokenize": ("_TokenizeUnit",),
    "target": ("TargetWorker",),
    "drafter": ("DrafterWorker", "ColocatedWorker"),
}
KINDS = FAULT_KINDS
assert set(KINDS) == {*VICTIMS, "node"}  # config names every kind a victim list here has
POLL_S = 0.2


@dataclass
class Fault:
    kind: str
    delay_s: float  # after its victims first show up
    seen_at: float | None = None
    fired_at: float | None = None
    victim: str = ""


def _signal(pid: int | None) -> None:
    """SIGKILL `pid`, or with None this worker's parent: the raylet, and so the whole node."""
    import os
    import signal

    os.kill(pid if pid is not None else os.getppid(), signal.SIGKILL)


class Injector:
    """A driver thread that fires the planned faults; `summary()` says what it did."""

    def __init__(self, cfg: ChaosConfig):
        self.rng = random.Random(cfg.seed)
        self.faults = [Fault(kind, round(self.rng.uniform(0, window), 2)) for kind, window in parse_faults(cfg)]
        self.started = time.monotonic()
        self._hit: set[str] = set()  # the actors there when a fault fired: no later fault's victims
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def __enter__(self) -> Injector:
        if self.faults:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        import logging

        log = logging.getLogger(__name__)
        while not self._stop.wait(POLL_S):
            pending = [f for f in self.faults if f.fired_at is None]
            if not pending:
                return
            try:
                self._tick(pending)
            except Exception as e:  # the cluster between states (a node going): look again
                log.debug("chaos: %s", e)

    def _tick(self, pending: list[Fault]) -> None:
        import ray
        from ray._private import state
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # an actor still in its constructor (loading weights, an engine) is a victim too: a crash
        # there is as real as one mid-step, and a short-lived actor may never be idle alive
        listed = state.actors()
        actors = [
            a
            for a in listed.values()
            if a["ActorID"] not in self._hit
            and (a["State"] == "ALIVE" or (a["State"] == "PENDING_CREATION" and a.get("Pid")))
        ]
        now = time.monotonic()
        for fault in pending:
            victims = self._victims(fault.kind, actors)
            if not victims:
                continue
            if fault.seen_at is None:
                fault.seen_at = now
            if now - fault.seen_at < fault.delay_s:
                continue
            name, node, pid = self.rng.choice(sorted(victims))
            ray.remote(_signal).options(
                num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote(pid)
            fault.fired_at, fault.victim = now, name
            self._hit |= {a["ActorID"] for a in listed.values()}
            return  # one fault at a time: the next one sees the cluster it left

    @staticmethod
    def _victims(kind: str, actors: list[dict[str, Any]]) -> list[tuple[str, str, int | None]]:
        """(what it is, its node id, the pid to kill; None: the node's raylet)."""
        import ray

        if kind != "node":
            return [
                (f"{a['ActorClassName']} pid {a['Pid']}", a["Address"]["NodeID"], a["Pid"])
                for a in actors
                if any(part in a["ActorClassName"] for part in VICTIMS[kind])
            ]
        busy = {
            a["Address"]["NodeID"]
            for a in actors
            if any(part in a["ActorClassName"] for parts in VICTIMS.values() for part in parts)
        }
        return [
            (f"node {n['NodeManagerAddress']}", n["NodeID"], None)
            for n in ray.nodes()
            if n["Alive"] and n["NodeID"] in busy and "node:__internal_head__" not in n["Resources"]
        ]

    def summary(self) -> dict[str, Any]:
        fired = [(f, at) for f in self.faults if (at := f.fired_at) is not None]
        return {
            "planned": len(self.faults),
            "injected": len(fired),
            "faults": [{"kind": f.kind, "victim": f.victim, "at_s": round(at - self.started, 1)} for f, at in fired],
            "not_fired": [f.kind for f in self.faults if f.fired_at is None],
        }
