"""The training coordinator (a Ray actor that `stages/train.py` starts): the run's loop, read top down.

The coordinator owns the run: a deterministic, seeded sample order per epoch, split over the
streams; each stream's target computes the features of step t+1 while its drafter trains on step
t (`max_in_flight` batches ahead, so memory stays flat). Features go from a target to its drafters
by torch.distributed send/recv (`handoff`; NCCL between GPUs, gloo on the CPU), or with
`train.feature_transport=object_store` as an object reference each drafter resolves itself; with
`train.colocate` a stream is one actor and its features never leave the device. The drafters shard
their weights, gradients and optimizer state over their own ranks (`fsdp`: FSDP2). The
coordinator only handles sample ids, shapes, references and figures.

What it leans on, each behind a narrow interface: `streams` (placing and starting the stream
actors, elastic down to `train.min_streams`, every wait with a deadline), `recovery` (checkpoints
taken, committed, salvaged, resumed), `evaluation` (held-out waves and the graph shapes met before
step 0), `step_figures` (each step's metric row and gauges, the run's summary), `history` (the
rows, appended). The data position follows from the step and the seed, and the learning rate from
the samples behind the step, so a resume from step k replays exactly what an uninterrupted run does.
While streams are lost to a node the schedule is as wide as the streams that train
(`train.lost_streams=shrink`: one batch each a step, the step keeping its time, the learning rate
following the samples taken), or stays `train.num_streams` wide (`stand_in`: the placed streams take
the lost ones' batches, `schedule.slots`, several passes a step, so the steps and every sample's step
and rate are those of a run that lost nothing); the order of the samples is the same either way, and
so are their anchors. Once the lost streams are placed again the run grows back at its next
checkpoint (`GrowBack`, not a failure). A failure (an actor's death, a rank's
error, an actor past a deadline) restarts every stream actor from the last checkpoint, up to
`max_restarts`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dflash_ray.errors import DFlashError, failure_cause
from dflash_ray.train import evaluation, history
from dflash_ray.train.deadlines import Stalled
from dflash_ray.train.feeding import Feeder
from dflash_ray.train.profile import step_trace
from dflash_ray.train.recovery import Checkpoints, Origin
from dflash_ray.train.resolved import ResolvedRun
from dflash_ray.train.schedule import RunSamples, Schedule, passes, sample_lengths, slots
from dflash_ray.train.step_figures import Gauges, step_row, summary_of
from dflash_ray.train.streams import Streams, Team, make_teams
from dflash_ray.train.trackers import Trackers


log = logging.getLogger(__name__)


class GrowBack(Exception):
    """Lost streams can be placed again: the run stops its streams at a checkpoint it has just
    committed and starts again from it on more of them."""

    def __init__(self, streams: int):
        super().__init__(f"room for {streams} streams again")
        self.streams = streams


class Coordinator:
    def __init__(
        self,
        resolved: ResolvedRun,
        data: str,
        output: str,
        run_name: str,
        tracking_env: dict[str, str] | None = None,
    ):
        """`resolved`: the run as the driver resolved it (`preflight.resolve_run`: the pinned target, the
        placement, each drafter's settings, shape, start and folder), executed here, never derived
        again; `tracking_env`: the trackers' settings from the driver's environment."""
        self.stopping = False
        self.resolved = resolved
        self.target, self.data, self.output, self.cfg = resolved.target, data, output, resolved.cfg
        self.run_name = run_name  # actors are named `{run_name}-target-{s}` / `-drafter-{s}`
        self.teams, self.layer_ids = make_teams(resolved.drafters)  # layer_ids: what the targets capture
        self.streams = Streams(self.cfg, self.target, run_name, self.teams, self.layer_ids)
        self.gauges = [Gauges(run_name, team.name) for team in self.teams]
        self.schedule: Schedule | None = None  # `_plan`, in `run`
        self.total_steps: int | None = None
        self.step, self.restarts = 0, 0
        self.begun_at: int | None = None  # the step this run began at (its resume's), once resumed
        self.failures: list[str] = []  # what each restart recovered from
        self.grew_back: list[dict[str, int]] = []  # each time lost streams came back: the step, the streams
        self.resumed_from: list[int] = []  # the checkpoint step each restart went on from (0: the start)
        # the wall time failures cost: from a failure at step s until the run is past step s again
        self.seconds_lost = 0.0
        self.lost_since: tuple[int, float] | None = None
        self.failed_at: float | None = None
        self.restart_seconds: list[float] = []  # from each failure to the next step taken (placement, weights, compile)
        self.warm: list[dict[str, Any]] = []  # each start's warm-up: shapes met before step 0, seconds
        self.taken: dict[int, list[tuple[str, int]]] = {}  # step -> the samples it trained on, every stream's
        self.trackers = Trackers(self.cfg.train.trackers, output, tracking_env or {})

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The first drafter's metrics (the run's, with one drafter)."""
        return self.teams[0].metrics

    # -- the run ----------------------------------------------------------------------------
    def run(self, stop_after_step: int | None = None) -> dict[str, Any]:
        """Train to the end (or `stop_after_step`), restarting from the last checkpoint after a failure."""
        from ray.exceptions import RayActorError, RayTaskError

        started = time.perf_counter()
        self._plan()
        self.checkpoints = Checkpoints(
            self.streams, Origin(self.cfg, self.target, self.data, self.data_print, self.output), self.trackers.sync
        )
        tracked = self.trackers.start(self.run_name, self.cfg.to_dict())
        try:
            while True:
                try:
                    self._start()
                    self._train(stop_after_step)
                    break
                except GrowBack as e:  # not a failure: the run starts again on more streams
                    log.warning("step %d: %s; the run goes on from this step's checkpoint on them", self.step, e)
                    self.grew_back.append({"at_step": self.step, "streams": e.streams})
                except (RayActorError, RayTaskError, Stalled) as e:
                    if self.stopping:
                        raise DFlashError("stopped by the driver") from None
                    if isinstance(e, RayTaskError) and isinstance(e.cause, DFlashError):
                        raise e.cause from None  # bad input or settings: a restart would fail the same way
                    self._failed(e)
                finally:
                    self.streams.stop()
                    self.checkpoints.forget()
        finally:
            self.trackers.finish()
        for team in self.teams:  # the run's whole history in one file, once (`history`)
            history.write_whole(team.output, team.metrics)
        return summary_of(self, tracked, time.perf_counter() - started)

    def _plan(self) -> None:
        """The samples, the held-out split and the schedule. Run inside `run`, not the constructor, so
        a bad dataset or setting reaches the driver as its own error, not as a dead actor."""
        tcfg = self.cfg.train
        self.samples = RunSamples(self.data, tcfg)
        self.data_print = self.samples.fingerprint
        self._schedule_from((0, 0, 0))
        # held-out batches by length (`evaluation`), and every graph shape the drafters will meet
        # when something compiles them (compiled attention on GPUs, or the GPU's clocks replayed)
        heldout = self.samples.heldout
        held_lengths = sample_lengths(heldout) if heldout else []
        self.heldout_batches = evaluation.batches_by_length(heldout, held_lengths, tcfg.batch_size)
        self.shapes: list[tuple[int, int, bool]] = []
        if tcfg.clocks.scale > 0 or self.resolved.placement.attention == "flex":
            evaluated = self.heldout_batches if tcfg.eval_every else []
            self.shapes = evaluation.warm_shapes(
                self.samples.train_lengths(),
                evaluated,
                dict(zip(heldout, held_lengths)),
                tcfg.batch_size,
                tcfg.length_bucket,
            )

    def _schedule_from(self, origin: tuple[int, int, int]) -> None:
        """The schedule from `origin` over the streams that train (`train.lost_streams=shrink`), or
        over `train.num_streams` however many train (`stand_in`: `schedule.slots`)."""
        tcfg = self.cfg.train
        wide = tcfg.num_streams if tcfg.lost_streams == "stand_in" else self.streams.count or tcfg.num_streams
        self.schedule, self.total_steps = self.samples.schedule(wide, origin)

    def _start(self) -> None:
        """Place and start the streams, go on from the newest checkpoint, meet every graph shape."""

        self.streams.start(self.step)
        self.step = 0
        resumed = self.checkpoints.resume()
        if resumed is None:
            self._schedule_from((0, 0, 0))
        else:  # the data goes on from where it stood, whatever the number of streams that took it there
            self.step, states = resumed
            self.samples.group = states[0].get("length_group", self.samples.group)
            self._schedule_from((self.step, *states[0]["position"]))
        self.taken = {k: v for k, v in self.taken.items() if k <= self.step}  # the steps past it are taken again
        if self.shapes:
            self.warm.append(self.streams.warm_up(self.shapes))
        if self.begun_at is None:
            self.begun_at = self.step
        if self.restarts:
            self.resumed_from.append(self.step)
        self._regained()

    def _failed(self, e: Exception) -> None:
        """An actor died, a rank raised (out of memory) or an actor missed a deadline: the others may
        wait in a collective; every stream actor is stopped and the run goes on from its checkpoint."""
        self.restarts += 1
        self.failed_at = self.failed_at or time.perf_counter()
        self.failures.append(f"step {self.step + 1}: {failure_cause(e)}")
        self.checkpoints.salvage()
        self.streams.note_lost(self.step)
        if self.lost_since is None:  # a failure while redoing steps: still the first one's loss
            self.lost_since = (self.step, time.perf_counter())
        if self.restarts > self.cfg.train.max_restarts:
            raise DFlashError(
                f"a stream failed {self.restarts} times, over the budget of "
                f"{self.cfg.train.max_restarts} restarts; last: {failure_cause(e)}",
                field="train.max_restarts",
            ) from None

    # -- the loop ---------------------------------------------------------------------------
    def _train(self, stop_after_step: int | None) -> None:
        tcfg = self.cfg.train
        assert self.total_steps is not None  # `_plan` ran
        assert self.schedule is not None
        stall = self.cfg.train.stall_step if self.restarts == 0 else 0  # the drill's, in the first attempt only
        self.feeder = Feeder(self.streams, self.schedule, self.total_steps, self._trace, stall)
        if tcfg.eval_every and self.step == 0 and self.teams[0].heldout_start is None:
            # the untrained start: what learning is measured against
            for team, tau in zip(self.teams, self._evaluate()):
                team.heldout_start = tau
        while self.step < self.total_steps:
            start = time.perf_counter()
            stats, wait_s = self._colocated_step() if tcfg.colocate else self._paired_step()
            self._done(stats, wait_s, time.perf_counter() - start)
            if tcfg.eval_every and (self.step % tcfg.eval_every == 0 or self.step == self.total_steps):
                for team, gauges, tau in zip(self.teams, self.gauges, self._evaluate()):
                    team.metrics[-1]["heldout_tau"] = tau
                    if tau is not None:
                        gauges.set("heldout_tau", tau)
            self.trackers.log_rows(self.step, {team.name: team.metrics[-1] for team in self.teams})
            stopping = stop_after_step is not None and self.step >= stop_after_step
            if self.checkpoints.due(self.step, self.step == self.total_steps or stopping):
                taken = self._checkpoint()
                if taken and self.step < self.total_steps and not stopping and (grown := self.streams.grown()):
                    self.checkpoints.commit(wait=True)  # the run goes on from this checkpoint
                    raise GrowBack(self.streams.count + grown)
            else:
                self.checkpoints.commit(wait=False)  # the checkpoint in flight, as soon as its files are written
            if stopping:
                break
        self.checkpoints.commit(wait=True)

    def _point(self) -> dict[str, Any]:
        """What every drafter call of this step is told: where it stands in samples (its learning
        rate), and the passes each rank makes (more than one while streams are lost)."""
        assert self.schedule is not None and self.total_steps is not None
        point = self.schedule.point(self.step, self.total_steps)
        return {"point": point, "passes": passes(self.streams.count, self.schedule.streams)}

    def _colocated_step(self) -> tuple[list[dict[str, Any]], float]:
        """Each stream computes its own features in place and trains on them."""
        assert self.schedule is not None
        drafters, n, wanted = self.streams.drafters, self.streams.count, self.schedule.streams
        refs = [
            d.train_samples.remote(
                self.step,
                [self.schedule.batch_for(self.step, slot) for slot in slots(s, n, wanted)],
                **self._point(),
                fault=self._fault(s),
                profile=self._trace(self.step, "stream", s),
            )
            for s, d in enumerate(drafters)
        ]
        return self.streams.wait(refs, drafters, f"step {self.step + 1}"), 0.0

    def _paired_step(self) -> tuple[list[dict[str, Any]], float]:
        """The targets' batches up to `max_in_flight` steps ahead, then this step's drafters on theirs."""
        import ray

        n, streams = self.streams.count, self.streams
        self.feeder.submit(self.step)
        refs = self.feeder.take(self.step)
        ready_at = time.perf_counter()
        # a target stuck in its forward or its read is named here, past the deadline
        limit = streams.deadlines.limit(len(refs[0]))
        every = [r for stream in refs for r in stream]
        ready, _ = ray.wait(every, num_returns=len(every), timeout=limit)
        late = [s for s in range(n) if any(r not in ready for r in refs[s])]
        if late:
            streams.missed(f"step {self.step + 1}'s features", [streams.targets[s] for s in late], limit)
        wait_s = time.perf_counter() - ready_at
        # each drafter resolves its own stream's features (every drafter of a stream the same
        # reference): they never pass through here. The batches ahead are watched meanwhile: a
        # target that dies is known now, not when its drafter's receive times out
        watch = self.feeder.in_flight() if streams.direct else None
        refs = [
            d.train_step.remote(
                self.step,
                *refs[s],
                **self._point(),
                fault=self._fault(s),
                profile=self._trace(self.step, "drafter", s, team),
            )
            for team in self.teams
            for s, d in enumerate(team.drafters)
        ]
        return streams.wait(refs, streams.drafters, f"step {self.step + 1}", watch=watch), wait_s

    def _done(self, stats: list[dict[str, Any]], wait_s: float, step_s: float) -> None:
        """Step bookkeeping: the samples taken, the clocks, each drafter's metric row."""
        assert self.schedule is not None
        n = self.streams.count
        self.taken[self.step + 1] = [
            x for slot in range(self.schedule.streams) for x in self.schedule.batch_for(self.step, slot)
        ]
        self.step += 1
        self._regained()
        self.streams.deadlines.observe(step_s)
        if self.failed_at is not None:  # the first step after a restart: what the restart cost
            self.restart_seconds.append(round(time.perf_counter() - self.failed_at, 1))
            self.failed_at = None
        for i, (team, gauges) in enumerate(zip(self.teams, self.gauges)):
            row = step_row(self.step, stats[i * n : (i + 1) * n], wait_s, step_s, n)
            team.metrics.append(row)
            gauges.show(row)

    def _evaluate(self) -> list[float | None]:
        """Each drafter's simulated tau on the held-out samples, in waves (`evaluation`)."""
        return evaluation.evaluate(self.streams, self.heldout_batches, self.cfg.train.max_in_flight + 1, self.step)

    def _checkpoint(self) -> bool:
        """A checkpoint of this step (`recovery`): where the data stands, for any stream count. Put off
        (False) while the targets' sends are posted and the last checkpoint is still being written."""
        assert self.schedule is not None and self.total_steps is not None  # `_plan` ran
        position = list(self.schedule.position(self.step))
        posted = self.streams.direct and bool(self.feeder.in_flight()) and self.step < self.total_steps
        return self.checkpoints.take(self.step, self.total_steps, position, self.samples.group, posted)

    def _regained(self) -> None:
        if self.lost_since is not None and self.step >= self.lost_since[0]:
            self.seconds_lost += time.perf_counter() - self.lost_since[1]
            self.lost_since = None

    def _fault(self, stream: int) -> bool:
        """`train.fault_step`: drafter rank 1 raises at that step, in the run's first attempt only."""
        return stream == 1 and self.restarts == 0 and self.step + 1 == self.cfg.train.fault_step

    def _trace(self, step: int, role: str, rank: int, team: Team | None = None) -> str | None:
        return step_trace(self.cfg.train.profile_steps, (team or self.teams[0]).output, step, role, rank)

    # -- what the driver sees ---------------------------------------------------------------
    def stop(self) -> None:
        """Stop the stream actors and free their placement groups now (the driver was interrupted):
        a placement group outlives the actor that made it until its job ends, and would hold the
        resources a resume in the same driver asks for. The run does not restart them."""
        self.stopping = True
        self.streams.stop()

    def progress(self, since: int = 0) -> dict[str, Any]:
        """Where the run stands, and the first drafter's metric rows from index `since` on."""
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "restarts": self.restarts,
            "last": self.metrics[-1] if self.metrics else None,
            "rows": self.metrics[since:],
            "count": len(self.metrics),
            "streams": self.streams.count,
            "begun_at": self.begun_at,
        }
