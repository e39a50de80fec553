"""A run's checkpoints as the coordinator takes, commits, salvages and resumes from them.

Each drafter rank copies its shard of the weights and optimizer state to host memory and writes
it in the background while training goes on (`checkpoint_files`); the run state (step, data position, every
anchor RNG) is taken at once, and the manifest committed once every rank's files are written, one
checkpoint in flight at a time. After a failure the checkpoint in flight is still committed if every
rank finishes writing it. A resume takes the newest checkpoint that verifies for every drafter of
the run, refusing one of another run (other training settings, data or target). The files' format
is `checkpoint`'s.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Callable

from dflash_ray.config import RunConfig, TrainConfig
from dflash_ray.errors import DFlashError
from dflash_ray.train import checkpoint, history
from dflash_ray.train.streams import CHECKPOINT_THREAD, Streams

# settings that change how a run executes, not what it trains: free to differ on resume (each marked
# so beside its field, `config.operational`): num_streams, for one, since checkpoints reshard and the
# data goes on from its position (`Schedule`); max_steps recomputes the rates' schedule over the new total
log = logging.getLogger(__name__)

OPERATIONAL = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("operational")}


@dataclasses.dataclass(frozen=True)
class Origin:
    """What the run is, as a checkpoint records it and a resume compares."""

    cfg: RunConfig
    target: str
    data: str
    data_print: str
    output: str


def differences(state: dict[str, Any], origin: Origin) -> list[str]:
    """What a checkpoint's run did otherwise than this one: training settings (but `OPERATIONAL`
    ones), the data (its path or its content) or the target."""
    saved = state["config"]["train"]
    now = origin.cfg.to_dict()["train"]
    default = dataclasses.asdict(TrainConfig())  # a setting newer than the checkpoint: at its default
    changed = [f"train.{k}" for k in sorted(now) if k not in OPERATIONAL and saved.get(k, default.get(k)) != now[k]]
    changed += [
        f"{name} (checkpoint: {state.get(name)}, now: {value})"
        for name, value in (("data", origin.data), ("target", origin.target))
        if state.get(name) != value
    ]
    if state.get("data_print", origin.data_print) != origin.data_print:
        changed.append(
            f"the data's content at {origin.data} (checkpoint: {state['data_print']}, now: "
            f"{origin.data_print}): it was rewritten since"
        )
    return changed


class Checkpoints:
    """The checkpoint in flight and the last one taken."""

    def __init__(self, streams: Streams, origin: Origin, on_commit: Callable[[], None] = lambda: None):
        self.streams, self.origin, self.on_commit = streams, origin, on_commit
        self.uploading: tuple[int, list[dict]] | None = None  # (step, run states) of a checkpoint uploading
        self.step = -1  # the step of the newest checkpoint taken
        self.put_off: int | None = None  # the step of a checkpoint put off while sends were posted
        self.taken_at = time.monotonic()

    def due(self, step: int, last: bool) -> bool:
        """A checkpoint is due after `step`: every `checkpoint_every` steps, at the end,
        `checkpoint_every_minutes` after the last one, or put off from an earlier step (`take`)."""
        tcfg = self.origin.cfg.train
        minutes = tcfg.checkpoint_every_minutes
        late = minutes > 0 and time.monotonic() - self.taken_at >= 60 * minutes
        return step % tcfg.checkpoint_every == 0 or last or late or self.put_off is not None

    def take(
        self, step: int, total_steps: int, position: list[int], length_group: int, sends_posted: bool = False
    ) -> bool:
        """Take a checkpoint of `step`: every drafter rank writes its files in the background; the
        run state of each drafter (the step, where the data stands, every rank's anchor RNG) is taken
        now, and committed with the manifest once every rank's files are written (`commit`).

        One upload at a time: the last one must be committed first. With `sends_posted` (the targets'
        sends of the next steps wait for their drafters, and NCCL's watchdog counts their age), a
        checkpoint whose previous upload is still being written is put off to the next step rather
        than waited for; returns False then."""
        if sends_posted and self.uploading is not None:
            self.commit(wait=False)
            if self.uploading is not None:
                if self.put_off is None:
                    self.put_off = step
                    log.info("checkpoint %d put off: checkpoint %d is still being written", step, self.uploading[0])
                return False
        self.commit(wait=True)
        self.put_off = None
        teams, origin = self.streams.teams, self.origin
        for team in teams:  # a manifest of an earlier run at this step no longer counts
            checkpoint.begin(team.output, step)
        self.taken_at, self.step = time.monotonic(), step
        drafters = self.streams.drafters
        self.streams.wait(
            [d.write_checkpoint_files.remote(team.output, step) for team in teams for d in team.drafters],
            drafters,
            f"checkpoint {step}",
        )
        rngs = self.streams.wait([d.rng_state.remote() for d in drafters], drafters, "the anchor generators")
        n = self.streams.count
        states = [
            {
                "step": step,
                "total_steps": total_steps,
                "drafter": team.name,
                "position": position,
                "length_group": length_group,
                "rng": [r.hex() for r in rngs[i * n : (i + 1) * n]],
                "streams": n,
                "heldout_start": team.heldout_start,  # what learning is measured against, after a resume too
                "config": origin.cfg.to_dict(),
                "target": origin.target,
                "data": origin.data,
                "data_print": origin.data_print,
            }
            for i, team in enumerate(teams)
        ]
        self.uploading = (step, states)
        return True

    def commit(self, wait: bool) -> None:
        """Commit the checkpoint in flight once every drafter rank has written its files (now, with
        `wait`): the run state, then the manifest, last; then rotate."""
        if self.uploading is None:
            return
        drafters = self.streams.drafters
        limit = self.streams.deadlines.limit(self.origin.cfg.train.checkpoint_every) if wait else None
        written = self.streams.wait(
            [d.upload_entries.remote(wait) for d in drafters], drafters, "a checkpoint's upload", limit
        )
        if any(entries is None for entries in written):
            return
        self._commit(written)

    def _commit(self, written: list[dict[str, dict]]) -> None:
        n = self.streams.count  # every rank of every drafter writes its own shard
        assert self.uploading is not None  # a checkpoint is in flight
        step, states = self.uploading
        for i, (team, state) in enumerate(zip(self.streams.teams, states)):
            entries = {name: entry for ranks in written[i * n : (i + 1) * n] for name, entry in ranks.items()}
            entries["state.json"] = checkpoint.write_file(team.output, step, "state.json", json.dumps(state).encode())
            checkpoint.commit(team.output, step, entries, {"step": step})
            checkpoint.rotate(team.output, self.origin.cfg.train.keep_checkpoints, upto=step)
            # the rows since the last commit, appended (`history`): never the whole run again
            history.append(team.output, [m for m in team.metrics if team.appended < m["step"] <= step], step)
            team.appended = step
        self.uploading = None
        self.on_commit()

    def salvage(self) -> None:
        """After a failure, commit the checkpoint in flight if every drafter rank still finishes
        writing its files: a failure moments after a checkpoint (whose upload can take minutes at
        scale) must not cost the steps before it. Each rank answers on its checkpoint thread, since
        its training thread may wait in a collective the failed rank left; a dead rank's files are
        lost, and that checkpoint with them."""
        import ray

        if self.uploading is None:
            return
        drafters = self.streams.drafters
        refs = [d.upload_entries.options(concurrency_group=CHECKPOINT_THREAD).remote(True) for d in drafters]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.origin.cfg.train.collective_timeout_s)
        if len(ready) < len(refs):
            return
        try:
            written = ray.get(refs)
        except ray.exceptions.RayError:
            return
        self._commit(written)

    def forget(self) -> None:
        """The actors are gone: an upload still in flight ends with them (no manifest, never used)."""
        self.uploading = None

    def resume(self) -> tuple[int, list[dict[str, Any]]] | None:
        """Load the newest checkpoint that verifies (for every drafter of the run, at one step) into
        the drafters; returns its step and each drafter's run state, or None when there is none.
        The coordinator reads the manifest and `state.json` alone (the weights and optimizer state
        can be tens of GB): each drafter reads and checks its own, and a checkpoint a drafter finds
        corrupt gives way to the one before. A checkpoint of another run is refused."""
        import ray

        teams, rejected = self.streams.teams, []
        steps = set.intersection(*(set(checkpoint.complete_steps(t.output)) for t in teams))
        for step in sorted(steps, reverse=True):
            try:
                states = []
                for team in teams:
                    files = checkpoint.verify(team.output, step)  # every file there, at its size
                    states.append(json.loads(checkpoint.read_file(team.output, step, "state.json", files)))
            except checkpoint.CorruptCheckpoint as e:
                rejected.append(f"step {step}: {e}")
                continue
            changed = differences(states[0], self.origin)
            if changed:
                raise DFlashError(
                    f"the checkpoint was made with other settings ({', '.join(changed)} differ): "
                    "resuming would not continue the same run",
                    file=self.origin.output,
                )
            try:
                self.streams.wait(
                    [d.load_checkpoint.remote(team.output, step) for team in teams for d in team.drafters],
                    self.streams.drafters,
                    f"loading checkpoint {step}",
                )
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, checkpoint.CorruptCheckpoint):
                    raise
                rejected.append(f"step {step}: {e.cause}")  # the drafter's own words, not its traceback
                continue
            if rejected:
                log.warning("resuming from step %d; newer checkpoints do not verify: %s", step, "; ".join(rejected))
            for team, state in zip(teams, states):  # row k: the k-th step, done
                history.drop_after(team.output, step)  # the steps past it are taken again
                # a checkpoint older than the run's history carried its rows in its state
                team.metrics = history.read(team.output, step) or [
                    m for m in state.get("metrics", []) if m["step"] <= step
                ]
                team.appended = step
                team.heldout_start = state.get("heldout_start")
            return step, states
        for team in teams:  # no checkpoint: the run starts over, and its history with it
            history.drop_after(team.output, 0)
            team.metrics, team.appended = [], 0
        if rejected:
            raise DFlashError(
                f"no checkpoint verifies ({'; '.join(rejected)}): resuming would start over; delete "
                "the checkpoints or choose another --output",
                file=self.origin.output,
            )
        return None
