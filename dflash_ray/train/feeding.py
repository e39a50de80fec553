"""The targets' batches, posted ahead of their drafters: each stream's target computes (and with
send/recv features, posts) the batches of up to `train.max_in_flight` steps ahead while its
drafters train on this one, so memory stays flat and no drafter waits for a forward."""

from __future__ import annotations

from typing import Any, Callable

from dflash_ray.train.schedule import Schedule, slots


class Feeder:
    """The batches in flight of one attempt of a run, per stream."""

    def __init__(
        self,
        streams: Any,
        schedule: Schedule,
        total_steps: int,
        trace: Callable[[int, str, int], str | None],
        stall_step: int = 0,
    ):
        """`streams`: the run's `Streams`; `trace`: where a step's target trace goes (or None);
        `stall_step`: the step at which target 1 blocks in its reader (`train.stall_step`, the
        deadlines' drill; 0: never)."""
        self.streams, self.schedule, self.total_steps = streams, schedule, total_steps
        self.trace, self.stall_step = trace, stall_step
        self.ahead: list[dict[int, list]] = [{} for _ in range(streams.count)]

    def horizon(self, step: int) -> int:
        """The steps whose batches may be sent while the run stands at `step`. An evaluation's
        features travel the same pairs as training's, and NCCL matches a pair's messages by order
        alone: a batch sent ahead past an evaluation would meet the evaluation's receive. So batches
        past the next evaluation wait for it (one target forward of idle drafters per evaluation)."""
        every = self.streams.cfg.train.eval_every
        if not (self.streams.direct and every):
            return self.total_steps
        return min(self.total_steps, (step // every + 1) * every)

    def submit(self, step: int) -> None:
        """The batches of `step` .. `step + max_in_flight` posted to every target that has not got
        them, within the horizon: each stream's own, and those of its slots (`schedule.slots`) when
        it stands in for lost streams, in order (a drafter receives them in that order)."""
        n, teams = self.streams.count, len(self.streams.teams)
        wanted = self.schedule.streams
        limit = self.horizon(step)
        for ahead in range(step, step + self.streams.cfg.train.max_in_flight + 1):
            for s, target in enumerate(self.streams.targets):
                if ahead >= limit or ahead in self.ahead[s]:
                    continue
                trace = self.trace(ahead, "target", s)
                stall = s == min(1, n - 1) and ahead + 1 == self.stall_step
                posted = []
                for slot in slots(s, n, wanted):
                    batch = self.schedule.batch_for(ahead, slot)
                    if self.streams.direct:  # posted to every drafter of the stream; only the shapes come back
                        dsts = [self.streams.layout.drafter(i, s) for i in range(teams)]
                        posted.append(target.send_features.remote(batch, dsts, profile=trace, stall=stall))
                    else:
                        posted.append(target.features.remote(batch, profile=trace, stall=stall))
                    trace, stall = None, False
                self.ahead[s][ahead] = posted

    def take(self, step: int) -> list[list]:
        """Each stream's batches of `step` (object references), no longer in flight here."""
        return [self.ahead[s].pop(step) for s in range(self.streams.count)]

    def in_flight(self) -> list:
        """The references of every batch still ahead."""
        return [r for per_stream in self.ahead for refs in per_stream.values() for r in refs]
