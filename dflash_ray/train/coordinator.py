"""The training coordinator (a Ray actor that `stages/train.py` starts): it drives N target→drafter streams.

The coordinator owns the run: a deterministic, seeded sample order per epoch, split over the
streams; each stream's target computes the features of step t+1 while its drafter trains on step
t (`max_in_flight` batches ahead, so memory stays flat). Features go from a target to its drafters
by torch.distributed send/recv (`handoff`: one process group of every stream actor, its store on
target 0's node; NCCL between GPUs, gloo on the CPU), or with `train.feature_transport=object_store`
as an object reference each drafter resolves itself; with `train.colocate` a stream is one actor
and its features never leave the device. The drafters shard their weights, gradients and optimizer
state over their own ranks (`sharding`: FSDP2). The coordinator only handles sample ids, shapes,
references and figures.

With `train.drafters` each stream has one drafter actor per drafter of the run (a `Team` is one
drafter's actors over the streams, with its own process group, checkpoints, metrics and output
folder): the target captures the union of their layers once and sends them to each.

Checkpoints every `checkpoint_every` steps and at the end: each drafter rank writes its own shard
of the weights and optimizer state in the background while training goes on (`shards`); the
coordinator takes the run state (step, every drafter's anchor RNG) at once and commits the manifest
once every rank's files are written. The data position follows from the step and
the seed, and the learning rate from the step, so a resume from step k replays exactly what an
uninterrupted run does. An actor that dies is replaced: every actor restarts from the last
checkpoint, up to `max_restarts`.
"""

from __future__ import annotations

import dataclasses

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from dflash_ray import manifest, storage
from dflash_ray.cluster import on_node
from dflash_ray.config import RunConfig
from dflash_ray.drafter.families import mask_and_layer_ids
from dflash_ray.errors import DFlashError, failure_cause
from dflash_ray.train import checkpoint, elastic, evaluation, history
from dflash_ray.train.deadlines import Deadlines, Stalled
from dflash_ray.train.devices import stream_bundles
from dflash_ray.train.drafters import union_layers
from dflash_ray.train.handoff import Layout
from dflash_ray.train.schedule import (
    Schedule,
    dataset_samples,
    length_group,
    sample_lengths,
    sample_prompts,
    split_heldout,
)
from dflash_ray.train.trackers import Trackers
from dflash_ray.train.workers import ColocatedWorker, DrafterWorker, TargetWorker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _node(_worker) -> str:
    """Run inside a stream actor (`__ray_call__`): the address of the node it runs on."""
    import ray

    return ray.util.get_node_ip_address()


def _rendezvous(_worker) -> tuple[str, int]:
    """Run inside drafter rank 0 (`__ray_call__`): its node's address and a port free there, where
    its process group store will listen."""
    import ray

    return ray.util.get_node_ip_address(), _free_port()


def drafter_actor(cls):
    """A drafter role as an actor that answers for its checkpoint files on a thread of its own
    (`Coordinator._salvage`), its training calls still one at a time."""
    import ray

    return ray.remote(concurrency_groups={CHECKPOINT_THREAD: 1})(cls)


def first_error(refs: list) -> list:
    """The results of one step's calls on every stream; a rank's error is raised as soon as it is
    known, while the other ranks may still wait for it in a collective."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(refs)


CHECKPOINT_THREAD = "checkpoint"  # a drafter actor's concurrency group for its checkpoint files

# settings that change how a run executes, not what it trains: free to differ on resume
OPERATIONAL = {
    "actor_cpus",
    "actor_gpus",
    "torch_threads",
    "max_in_flight",
    "checkpoint_every",
    "keep_checkpoints",
    "max_restarts",
    "eval_every",
    "colocate",
    "node_resource",
    "trackers",
    "collective_timeout_s",
    "fault_step",
    "min_bus_bandwidth",
    "feature_transport",
    "allow_slow_target",
    "profile_steps",
    "num_streams",
    "min_streams",
    "placement_timeout_s",
    "checkpoint_every_minutes",
    "deadline_floor_s",
    "deadline_factor",
    "clocks",
    "stall_step",
    "feature_cache_gb",
}  # num_streams: checkpoints reshard, the data goes on (`Schedule`)


@dataclass
class Team:
    """One drafter of the run: its settings, its actors (one per stream, a process group of their
    own), where it writes, and its figures."""

    name: str  # "" for a run's only drafter
    cfg: RunConfig  # the run's settings with this drafter's own (`train.drafters`)
    drafter_cfg_json: str
    init: str
    output: str  # the run's output, or OUTPUT/NAME
    layer_ids: list[int]
    pick: list[int] | None = None  # its layers' positions among the captured ones (None: all of them)
    drafters: list = field(default_factory=list)
    rendezvous: tuple[str, int] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    appended: int = 0  # the last step whose metric row is in the run's history (`history`)
    heldout_start: float | None = None  # held-out tau before the first step (a fresh run)
    gauges: dict[str, Any] = field(default_factory=dict)


class Coordinator:
    def __init__(
        self,
        target: str,
        data: str,
        output: str,
        cfg: RunConfig,
        run_name: str,
        drafters: list[tuple[str, RunConfig, dict, str]],
        tracking_env: dict[str, str] | None = None,
    ):
        """`drafters`: (name, its settings, `drafter_config`, `drafter_init`) for each drafter of the
        run, computed on the driver; `tracking_env`: the trackers' settings from the driver's environment."""
        self.stopping = False
        self.target, self.data, self.output, self.cfg = target, data, output, cfg
        self.run_name = run_name  # actors are named `{run_name}-target-{s}` / `-drafter-{s}`
        # `_plan`, in `run`
        self.heldout: list[tuple[str, int]] = []
        self.schedule: Schedule | None = None
        self.total_steps: int | None = None
        self.failures: list[str] = []  # what each restart recovered from
        self.resumed_from: list[int] = []  # the checkpoint step each restart went on from (0: the start)
        self.teams = [
            Team(
                name,
                team_cfg,
                json.dumps(drafter_cfg),
                init,
                storage.join(output, name) if name else output,
                mask_and_layer_ids(drafter_cfg)[1],
            )
            for name, team_cfg, drafter_cfg, init in drafters
        ]
        self.layer_ids, picks = union_layers([t.layer_ids for t in self.teams])  # what the targets capture
        for team, pick in zip(self.teams, picks):
            team.pick = pick
        self.step, self.restarts = 0, 0
        self.begun_at: int | None = None  # the step this run began at (its resume's), once resumed
        # the wall time failures cost: from a failure at step s until the run is past step s again
        self.seconds_lost = 0.0
        self.lost_since: tuple[int, float] | None = None
        self.uploading: tuple[int, list[dict]] | None = None  # (step, run states) of a checkpoint uploading
        self.targets: list[Any] = []  # actor handles
        self.groups: list[Any] = []  # placement groups
        self.stream_nodes: set[str] = set()  # every node a stream actor ran on, over restarts too
        self.slow_kernels: list[str] = []  # fast kernels a hybrid target ran without (train.allow_slow_target)
        self.streams = cfg.train.num_streams  # the streams placed now (`elastic`): num_streams, or fewer
        self.deadlines = Deadlines(cfg.train.deadline_floor_s, cfg.train.deadline_factor)
        self.lost_nodes: list[dict[str, Any]] = []  # nodes the streams ran on that left the cluster
        self.restart_seconds: list[float] = []  # from each failure to the next step taken (placement, weights, compile)
        self.failed_at: float | None = None
        self.warm: list[dict[str, Any]] = []  # each start's warm-up: shapes met before step 0, seconds
        self.checkpointed_at = time.monotonic()
        self.checkpoint_step = -1  # the step of the newest checkpoint taken
        self.taken: dict[int, list[tuple[str, int]]] = {}  # step -> the samples it trained on, every stream's
        self.trackers = Trackers(cfg.train.trackers, output, tracking_env or {})

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """The first drafter's metrics (the run's, with one drafter)."""
        return self.teams[0].metrics

    def _plan(self) -> None:
        """The samples, the held-out split and the schedule. Run inside `run`, not the constructor, so
        a bad dataset or setting reaches the driver as its own error, not as a dead actor."""
        tcfg = self.cfg.train
        samples = dataset_samples(self.data)
        self.data_print = manifest.fingerprint(self.data)  # a resume continues on the same data, not the same path
        prompts = sample_prompts(samples) if tcfg.heldout > 0 else None
        self.heldout, train_samples = split_heldout(samples, tcfg.heldout, tcfg.seed, prompts)
        self.train_samples = train_samples
        self.lengths = sample_lengths(train_samples) if tcfg.length_group != 0 else None
        # the balancing's run length, kept by resumes on another number of streams (the same order)
        self.length_group = length_group(tcfg)
        self._schedule_from((0, 0, 0))
        # held-out batches by length (`evaluation`), and every graph shape the drafters will meet
        # when something compiles them (compiled attention on GPUs, or the GPU's clocks replayed)
        held_lengths = sample_lengths(self.heldout) if self.heldout else []
        self.heldout_batches = evaluation.batches_by_length(self.heldout, held_lengths, tcfg.batch_size)
        self.shapes: list[tuple[int, int, bool]] = []
        if self._compiles():
            train_lengths = self.lengths if self.lengths is not None else sample_lengths(train_samples)
            self.shapes = evaluation.warm_shapes(
                train_lengths,
                self.heldout_batches if tcfg.eval_every else [],
                dict(zip(self.heldout, held_lengths)),
                tcfg.batch_size,
                tcfg.length_bucket,
            )

    def _compiles(self) -> bool:
        from dflash_ray.train.devices import planned_placement

        return self.cfg.train.clocks.scale > 0 or planned_placement(self.cfg).attention == "flex"

    def _schedule_from(self, origin: tuple[int, int, int]) -> None:
        """The schedule (and the run's length) from `origin` (`Schedule`): the start, or where a
        checkpoint made on another number of streams stood."""
        tcfg = self.cfg.train
        self.schedule = Schedule(
            self.train_samples,
            self.streams,
            tcfg.batch_size,
            tcfg.seed,
            origin,
            tcfg.shard_window,
            self.lengths,
            self.length_group,
        )
        total = self.schedule.total_steps(tcfg.epochs)
        self.total_steps = min(total, tcfg.max_steps) if tcfg.max_steps else total

    # -- actors -----------------------------------------------------------------------------
    def _start_actors(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tcfg = self.cfg.train
        resources = on_node(tcfg.node_resource)
        bundles = stream_bundles(tcfg)
        self.targets, self.groups = [], []
        for team in self.teams:
            team.drafters = []
        # as many streams as the cluster holds now, down to train.min_streams (`elastic`)
        self.groups = elastic.place_streams(tcfg, bundles)
        self.streams = n = len(self.groups)
        self.stream_nodes |= elastic.group_nodes(self.groups)
        self._note_lost_nodes()  # Ray may take seconds to call a node dead: named here if not at the failure
        self._schedule_from((0, 0, 0))  # a resume goes on from its checkpoint's position instead
        # the actors' settings say how many streams there are now (sharding, the process group)
        tcfg = dataclasses.replace(tcfg, num_streams=n)
        for s, pg in enumerate(self.groups):

            def at(index: int, role: str) -> dict:
                gpus = bundles[index].get("GPU", 0)
                return {
                    "num_cpus": tcfg.actor_cpus,
                    "num_gpus": gpus,
                    "resources": resources,
                    "name": f"{self.run_name}-{role}-{s}",
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
                }

            if tcfg.colocate:  # the stream's one actor is its target and its drafter
                team = self.teams[0]
                team.drafters.append(
                    drafter_actor(ColocatedWorker)
                    .options(**at(0, "stream"))
                    .remote(
                        self.target,
                        self.layer_ids,
                        team.drafter_cfg_json,
                        team.init,
                        dataclasses.replace(team.cfg.train, num_streams=n),
                        s,
                        n,
                    )
                )
                continue
            self.targets.append(
                ray.remote(TargetWorker).options(**at(0, "target")).remote(self.target, self.layer_ids, tcfg)
            )
            for i, team in enumerate(self.teams):
                role = f"drafter-{team.name}" if team.name else "drafter"
                team.drafters.append(
                    drafter_actor(DrafterWorker)
                    .options(**at(1 + i, role))
                    .remote(
                        self.target,
                        team.drafter_cfg_json,
                        team.init,
                        dataclasses.replace(team.cfg.train, num_streams=n),
                        s,
                        n,
                        team.pick,
                    )
                )
        # actors load their weights in their constructors: the start-up's deadline allows for it
        starting = self.deadlines.floor_s + tcfg.placement_timeout_s
        actors = self.targets + self.all_drafters
        self.stream_nodes.update(
            self._wait([a.__ray_call__.remote(_node) for a in actors], self._names(actors), "start-up", starting)
        )
        # a hybrid target on its GPU without its fast kernels: refused now, not found slow in hour five
        probed = self.all_drafters if tcfg.colocate else self.targets
        missing = self._wait([a.kernels.remote() for a in probed], self._names(probed), "the kernel check")
        self.slow_kernels = sorted({k for m in missing for k in m})
        if self.direct:  # one process group of every stream actor: features by send/recv
            # target 0 hosts the group's store: its own node's address, a port free there (as Ray Train does)
            rendezvous = ray.get(self.targets[0].__ray_call__.remote(_rendezvous), timeout=self.deadlines.limit())
            layout = self.layout
            self._wait(
                [t.join_run.remote(*rendezvous, s, layout) for s, t in enumerate(self.targets)]
                + [
                    d.join_run.remote(*rendezvous, i, layout)
                    for i, team in enumerate(self.teams)
                    for d in team.drafters
                ],
                self._names(self.targets + self.all_drafters),
                "joining the run's process group",
            )
            for team in self.teams:
                team.rendezvous = rendezvous
        else:
            for team in self.teams:  # each drafter's ranks form a process group of their own
                # rank 0 hosts the group's store: its own node's address, a port free there (as Ray Train does)
                team.rendezvous = ray.get(
                    team.drafters[0].__ray_call__.remote(_rendezvous), timeout=self.deadlines.limit()
                )
                self._wait(
                    [d.init_group.remote(*team.rendezvous) for d in team.drafters],
                    self._names(team.drafters),
                    "joining the drafters' process group",
                )
        ray.get([d.set_total_steps.remote(self.total_steps) for d in self.all_drafters])

    def _names(self, actors: list) -> list[str]:
        """What the log and the metrics call each of these actors: its role and stream."""
        names = {a: f"target {s}" for s, a in enumerate(self.targets)}
        for team in self.teams:
            role = "stream" if self.cfg.train.colocate else f"drafter {team.name}".strip()
            names.update({a: f"{role} {s}" for s, a in enumerate(team.drafters)})
        return [names.get(a, "actor") for a in actors]

    def _wait(self, refs: list, names: list[str], what: str, limit_s: float | None = None, watch=None) -> list:
        """The calls' results under a deadline (`deadlines`): an error as soon as it is known, and an
        actor past the deadline named (a log line and the `dflash_train_stalls` counter)."""
        try:
            return self.deadlines.wait(refs, names, what, limit_s, watch)
        except Stalled as e:
            from ray.util.metrics import Counter

            counter = Counter("dflash_train_stalls", description="actors that missed a deadline", tag_keys=("run",))
            counter.inc(len(e.late), tags={"run": self.run_name})
            raise

    @property
    def direct(self) -> bool:
        """Features go from a target to its drafters by send/recv (`handoff`), not as object references."""
        tcfg = self.cfg.train
        return not tcfg.colocate and tcfg.feature_transport == "direct"

    @property
    def layout(self) -> Layout:
        return Layout(self.streams, len(self.teams))

    @property
    def all_drafters(self) -> list:
        return [d for team in self.teams for d in team.drafters]

    def _stop_actors(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.targets + self.all_drafters:
            ray.kill(actor)
        self.uploading = None  # an upload still in flight ends with its actor: no manifest, never used
        for pg in self.groups:
            remove_placement_group(pg)
        self.targets, self.groups = [], []
        for team in self.teams:
            team.drafters = []

    def _resume(self) -> None:
        """Continue from the newest checkpoint that verifies (for every drafter of the run, at one
        step). The coordinator reads its manifest and `state.json` alone (the weights and optimizer
        state can be tens of GB): each drafter reads and checks those itself, and a checkpoint a
        drafter finds corrupt gives way to the one before. A checkpoint of another run (other
        training settings, data or target) is refused."""
        import logging

        import ray

        self.step, rejected = 0, []
        for team in self.teams:  # a restart with no checkpoint yet starts over: its rows go with it
            team.metrics = []
        now = self.cfg.to_dict()["train"]
        steps = set.intersection(*(set(checkpoint.complete_steps(t.output)) for t in self.teams))
        for step in sorted(steps, reverse=True):
            try:
                states = []
                for team in self.teams:
                    files = checkpoint.verify(team.output, step)  # every file there, at its size
                    states.append(json.loads(checkpoint.read_file(team.output, step, "state.json", files)))
            except checkpoint.CorruptCheckpoint as e:
                rejected.append(f"step {step}: {e}")
                continue
            state = states[0]
            saved = state["config"]["train"]
            # a setting newer than the checkpoint counts at its default (what the older run did)
            default = dataclasses.asdict(type(self.cfg.train)())
            changed = [
                f"train.{k}" for k in sorted(now) if k not in OPERATIONAL and saved.get(k, default.get(k)) != now[k]
            ]
            changed += [
                f"{name} (checkpoint: {state.get(name)}, now: {value})"
                for name, value in (("data", self.data), ("target", self.target))
                if state.get(name) != value
            ]
            if state.get("data_print", self.data_print) != self.data_print:
                changed.append(
                    f"the data's content at {self.data} (checkpoint: {state['data_print']}, now: "
                    f"{self.data_print}): it was rewritten since"
                )
            if changed:
                raise DFlashError(
                    f"the checkpoint was made with other settings ({', '.join(changed)} differ): "
                    "resuming would not continue the same run",
                    file=self.output,
                )
            try:
                self._wait(
                    [d.load_checkpoint.remote(team.output, step) for team in self.teams for d in team.drafters],
                    self._names(self.all_drafters),
                    f"loading checkpoint {step}",
                )
            except ray.exceptions.RayTaskError as e:
                if not isinstance(e.cause, checkpoint.CorruptCheckpoint):
                    raise
                rejected.append(f"step {step}: {e.cause}")  # the drafter's own words, not its traceback
                continue
            if rejected:
                logging.getLogger(__name__).warning(
                    "resuming from step %d; newer checkpoints do not verify: %s", step, "; ".join(rejected)
                )
            self.step = step
            self.taken = {k: v for k, v in self.taken.items() if k <= step}  # the steps past it are taken again
            # the data goes on from where it stood, whatever the number of streams that took it there
            self.length_group = state.get("length_group", self.length_group)
            self._schedule_from((step, *state["position"]))
            ray.get([d.set_total_steps.remote(self.total_steps) for d in self.all_drafters])
            for team, team_state in zip(self.teams, states):  # row k: the k-th step, done
                history.drop_after(team.output, step)  # the steps past it are taken again
                # a checkpoint older than the run's history carried its rows in its state
                team.metrics = history.read(team.output, step) or [
                    m for m in team_state.get("metrics", []) if m["step"] <= step
                ]
                team.appended = step
                team.heldout_start = team_state.get("heldout_start")
            return
        self.taken = {}
        for team in self.teams:  # no checkpoint: the run starts over, and its history with it
            history.drop_after(team.output, 0)
            team.appended = 0
        if rejected:
            raise DFlashError(
                f"no checkpoint verifies ({'; '.join(rejected)}): resuming would start over; delete "
                "the checkpoints or choose another --output",
                file=self.output,
            )

    # -- checkpoints ------------------------------------------------------------------------
    def _checkpoint(self) -> None:
        """Take a checkpoint of this step: every drafter rank copies its shard to host memory and
        writes it in the background while training goes on (`shards`); the run state is taken now,
        and the manifest written (`_commit`) once every rank's files are. One checkpoint is in flight
        at a time."""

        self._commit(wait=True)
        for team in self.teams:  # a manifest of an earlier run at this step no longer counts
            checkpoint.begin(team.output, self.step)
        self.checkpointed_at, self.checkpoint_step = time.monotonic(), self.step
        self._wait(
            [d.write_checkpoint_files.remote(team.output, self.step) for team in self.teams for d in team.drafters],
            self._names(self.all_drafters),
            f"checkpoint {self.step}",
        )
        rngs = self._wait([d.rng_state.remote() for d in self.all_drafters], self._names(self.all_drafters), "rng")
        n = self.streams
        assert self.schedule is not None  # `_plan` ran
        self.uploading = (
            self.step,
            [
                {
                    "step": self.step,
                    "total_steps": self.total_steps,
                    "drafter": team.name,
                    "position": list(self.schedule.position(self.step)),  # where the data stands, for any stream count
                    "length_group": self.length_group,
                    "rng": [r.hex() for r in rngs[i * n : (i + 1) * n]],
                    "streams": n,
                    "heldout_start": team.heldout_start,  # what learning is measured against, after a resume too
                    "config": self.cfg.to_dict(),
                    "target": self.target,
                    "data": self.data,
                    "data_print": self.data_print,
                }
                for i, team in enumerate(self.teams)
            ],
        )

    def _commit(self, wait: bool) -> None:
        """Commit the checkpoint in flight once rank 0 of every drafter has written its files (now,
        with `wait`): the run state, then the manifest, last; then rotate."""
        if self.uploading is None:
            return
        written = self._wait(
            [d.upload_entries.remote(wait) for d in self.all_drafters],
            self._names(self.all_drafters),
            "a checkpoint's upload",
            self.deadlines.limit(self.cfg.train.checkpoint_every) if wait else None,
        )
        if any(entries is None for entries in written):
            return
        self._commit_entries(written)

    def _commit_entries(self, written: list[dict[str, dict]]) -> None:
        """Commit the checkpoint in flight with every drafter rank's manifest entries."""
        n = self.streams  # every rank of every drafter writes its own shard
        assert self.uploading is not None  # a checkpoint is in flight
        step, states = self.uploading
        for i, (team, state) in enumerate(zip(self.teams, states)):
            entries = {name: entry for ranks in written[i * n : (i + 1) * n] for name, entry in ranks.items()}
            entries["state.json"] = checkpoint.write_file(team.output, step, "state.json", json.dumps(state).encode())
            checkpoint.commit(team.output, step, entries, {"step": step})
            checkpoint.rotate(team.output, self.cfg.train.keep_checkpoints, upto=step)
            # the rows since the last commit, appended (`history`): never the whole run again
            history.append(team.output, [m for m in team.metrics if team.appended < m["step"] <= step], step)
            team.appended = step
        self.uploading = None
        self.trackers.sync()

    def _salvage(self) -> None:
        """After a failure, commit the checkpoint in flight if every drafter rank still finishes
        writing its files: a failure moments after a checkpoint (whose upload can take minutes at
        scale) must not cost the steps before it. Each rank answers on its checkpoint thread, since
        its training thread may wait in a collective the failed rank left; a dead rank's files are
        lost, and that checkpoint with them."""
        import ray

        if self.uploading is None:
            return
        refs = [d.upload_entries.options(concurrency_group=CHECKPOINT_THREAD).remote(True) for d in self.all_drafters]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.train.collective_timeout_s)
        if len(ready) < len(refs):
            return
        try:
            written = ray.get(refs)
        except ray.exceptions.RayError:
            return
        self._commit_entries(written)

    def _evaluate(self) -> list[float | None]:
        """Simulated tau of each drafter on the held-out samples, their batches spread over every
        stream (a drafter's ranks hold the same weights, and each batch's anchors come from a fixed
        seed): no stream idles, and each batch's features are computed once for all the drafters.
        In waves (`evaluation`): a target posts a wave's sends only once its drafters took the last
        wave's, so no send waits long for its receive (NCCL's watchdog counts from the post)."""
        if not self.heldout_batches:
            return [None] * len(self.teams)
        n, teams = self.streams, len(self.teams)
        depth = self.cfg.train.max_in_flight + 1  # training's own window of batches sent ahead
        taus: list[list[float]] = [[] for _ in self.teams]
        for k, wave in enumerate(evaluation.waves(self.heldout_batches, n, depth)):
            what = f"evaluation wave {k + 1} (step {self.step})"
            limit = self.deadlines.limit(depth)
            if self.cfg.train.colocate:
                drafters = self.teams[0].drafters
                refs = [drafters[s].evaluate_samples.remote(b) for s, b in wave.batches]
                per_team = [self._wait(refs, self._names([drafters[s] for s, _ in wave.batches]), what, limit)]
            else:  # the training transport: with `handoff`, no training batch is in flight now (`_horizon`)
                if self.direct:
                    features = [
                        self.targets[s].send_features.remote(b, [self.layout.drafter(t, s) for t in range(teams)])
                        for s, b in wave.batches
                    ]
                else:
                    features = [self.targets[s].features.remote(b) for s, b in wave.batches]
                refs = [
                    team.drafters[s].evaluate.remote(f)
                    for team in self.teams
                    for (s, _), f in zip(wave.batches, features)
                ]
                actors = [team.drafters[s] for team in self.teams for s, _ in wave.batches]
                got = self._wait(refs, self._names(actors), what, limit, watch=features if self.direct else None)
                per_team = [got[i * len(wave.batches) : (i + 1) * len(wave.batches)] for i in range(teams)]
            for i, results in enumerate(per_team):
                taus[i] += [t for part, counted in zip(results, wave.counted) if counted for t in part]
        return [sum(flat) / len(flat) if flat else None for flat in taus]

    # -- the loop ---------------------------------------------------------------------------
    def _record(self, team: Team, stats: list[dict[str, float]], wait_s: float, step_s: float) -> None:
        tokens = sum(s["tokens"] for s in stats)
        row = {
            "step": self.step,
            "loss": stats[0]["loss"],
            "lr": stats[0]["lr"],
            "grad_norm": stats[0]["grad_norm"],
            "tau": sum(s["tau"] for s in stats) / len(stats),
            "acc_k1": sum(s["acc_k1"] for s in stats) / len(stats),
            "target_seconds": max(s["target_seconds"] for s in stats),
            "handoff_seconds": max(s["handoff_seconds"] for s in stats),
            "read_bytes": sum(s["read_bytes"] for s in stats),  # tokenized data the targets read
            # the longest stream's target tokens over the mean (the step waits for the longest)
            "straggler_ratio": max(s["tokens"] for s in stats) / max(1e-9, tokens / len(stats)),
            "drafter_seconds": max(s["drafter_seconds"] for s in stats),
            "optimizer_seconds": max(s["optimizer_seconds"] for s in stats),
            "wait_seconds": wait_s,
            "step_seconds": step_s,
            "tokens_per_s": tokens / max(step_s, 1e-9),
            "streams": self.streams,
        }
        peaks = [s["peak_flops"] for s in stats]
        if all(peaks):  # the drafters' model FLOPs over what their GPUs could do in the step
            row["mfu"] = sum(s["flops"] for s in stats) / (step_s * sum(peaks))
        team.metrics.append(row)
        for k, v in row.items():
            if k != "step":
                self._gauge(team, k).set(v)

    def _gauge(self, team: Team, name: str):
        from ray.util.metrics import Gauge

        if name not in team.gauges:
            gauge = Gauge(f"dflash_train_{name}", description=f"training {name}", tag_keys=("run", "drafter"))
            # two runs on one cluster, and the drafters of one run, stay apart
            gauge.set_default_tags({"run": self.run_name, "drafter": team.name or "drafter"})
            team.gauges[name] = gauge
        return team.gauges[name]

    def _regained(self) -> None:
        if self.lost_since is not None and self.step >= self.lost_since[0]:
            self.seconds_lost += time.perf_counter() - self.lost_since[1]
            self.lost_since = None

    def _fault(self, stream: int) -> bool:
        """`train.fault_step`: drafter rank 1 raises at that step, in the run's first attempt only."""
        return stream == 1 and self.restarts == 0 and self.step + 1 == self.cfg.train.fault_step

    def _trace(self, step: int, role: str, rank: int, team: Team | None = None) -> str | None:
        """Where the trace of `role` rank `rank` at `step` (0-based) goes, when `train.profile_steps`
        lists it: under its drafter's output (a target's and a stream's: the first drafter's)."""
        from dflash_ray.train.profile import trace_uri

        if step + 1 not in self.cfg.train.profile_steps:
            return None
        return trace_uri((team or self.teams[0]).output, step + 1, role, rank)

    def _horizon(self) -> int:
        """The steps whose batches may be sent now. An evaluation's features travel the same pairs as
        training's, and NCCL matches a pair's messages by order alone: a batch sent ahead past an
        evaluation would meet the evaluation's receive. So batches past the next evaluation wait for
        it (one target forward of idle drafters per evaluation)."""
        every = self.cfg.train.eval_every
        assert self.total_steps is not None  # `_plan` ran
        if not (self.direct and every):
            return self.total_steps
        return min(self.total_steps, (self.step // every + 1) * every)

    def _train(self, stop_after_step: int | None) -> None:
        import ray

        tcfg = self.cfg.train
        n = self.streams
        ahead: list[dict[int, Any]] = [{} for _ in range(n)]
        assert self.schedule is not None and self.total_steps is not None  # `_plan` ran

        def submit(step: int) -> None:
            assert self.schedule is not None
            for s, target in enumerate(self.targets):
                if step < self._horizon() and step not in ahead[s]:
                    batch = self.schedule.batch_for(step, s)
                    trace = self._trace(step, "target", s)
                    stall = s == min(1, n - 1) and self.restarts == 0 and step + 1 == tcfg.stall_step
                    if self.direct:  # posted to every drafter of the stream; only the shapes come back
                        dsts = [self.layout.drafter(i, s) for i in range(len(self.teams))]
                        ahead[s][step] = target.send_features.remote(batch, dsts, profile=trace, stall=stall)
                    else:
                        ahead[s][step] = target.features.remote(batch, profile=trace, stall=stall)

        if tcfg.eval_every and self.step == 0 and self.teams[0].heldout_start is None:
            # the untrained start: what learning is measured against
            for team, tau in zip(self.teams, self._evaluate()):
                team.heldout_start = tau
        while self.step < self.total_steps:
            start = time.perf_counter()
            if tcfg.colocate:  # each stream computes its own features in place
                wait_s = 0.0
                stats = self._wait(
                    [
                        d.train_samples.remote(
                            self.step,
                            self.schedule.batch_for(self.step, s),
                            self._fault(s),
                            self._trace(self.step, "stream", s),
                        )
                        for s, d in enumerate(self.all_drafters)
                    ],
                    self._names(self.all_drafters),
                    f"step {self.step + 1}",
                )
            else:
                for k in range(tcfg.max_in_flight + 1):
                    submit(self.step + k)
                refs = [ahead[s].pop(self.step) for s in range(n)]
                ready_at = time.perf_counter()
                # a target stuck in its forward or its read is named here, past the deadline
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.deadlines.limit())
                if len(ready) < len(refs):
                    late = [self._names(self.targets)[s] for s in range(n) if refs[s] not in ready]
                    self._wait([r for r in refs if r not in ready], late, f"step {self.step + 1}'s features", 0.0)
                wait_s = time.perf_counter() - ready_at
                # each drafter resolves its own stream's features (every drafter of a stream the same
                # reference): they never pass through here. The batches ahead are watched meanwhile: a
                # target that dies is known now, not when its drafter's receive times out
                watch = [r for s in range(n) for r in ahead[s].values()] if self.direct else None
                stats = self._wait(
                    [
                        d.train_step.remote(
                            self.step, refs[s], self._fault(s), self._trace(self.step, "drafter", s, team)
                        )
                        for team in self.teams
                        for s, d in enumerate(team.drafters)
                    ],
                    self._names(self.all_drafters),
                    f"step {self.step + 1}",
                    watch=watch,
                )
            self.taken[self.step + 1] = [x for s in range(n) for x in self.schedule.batch_for(self.step, s)]
            self.step += 1
            self._regained()
            step_s = time.perf_counter() - start
            self.deadlines.observe(step_s)
            if self.failed_at is not None:  # the first step after a restart: what the restart cost
                self.restart_seconds.append(round(time.perf_counter() - self.failed_at, 1))
                self.failed_at = None
            for i, team in enumerate(self.teams):
                self._record(team, stats[i * n : (i + 1) * n], wait_s, step_s)
            if tcfg.eval_every and (self.step % tcfg.eval_every == 0 or self.step == self.total_steps):
                for team, tau in zip(self.teams, self._evaluate()):
                    team.metrics[-1]["heldout_tau"] = tau
                    if tau is not None:
                        self._gauge(team, "heldout_tau").set(tau)
            if len(self.teams) == 1:
                self.trackers.log(self.step, self.metrics[-1])
            else:  # one run in the tracker, each drafter's figures under its name
                self.trackers.log(
                    self.step, {f"{t.name}/{k}": v for t in self.teams for k, v in t.metrics[-1].items() if k != "step"}
                )
            minutes = tcfg.checkpoint_every_minutes
            due = minutes > 0 and time.monotonic() - self.checkpointed_at >= 60 * minutes
            if self.step % tcfg.checkpoint_every == 0 or self.step == self.total_steps or due:
                self._checkpoint()
            else:
                self._commit(wait=False)  # the checkpoint in flight, as soon as its files are written
            if stop_after_step is not None and self.step >= stop_after_step:
                if self.checkpoint_step != self.step:
                    self._checkpoint()
                break
        self._commit(wait=True)

    def run(self, stop_after_step: int | None = None) -> dict[str, Any]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        started = time.perf_counter()
        self._plan()
        tracked = self.trackers.start(self.run_name, self.cfg.to_dict())
        try:
            while True:
                try:
                    self._start_actors()
                    self._resume()
                    self._warm_up()
                    if self.begun_at is None:
                        self.begun_at = self.step
                    if self.restarts:
                        self.resumed_from.append(self.step)
                    self._regained()
                    self._train(stop_after_step)
                    break
                except (RayActorError, RayTaskError, Stalled) as e:
                    if self.stopping:
                        raise DFlashError("stopped by the driver") from None
                    if isinstance(e, RayTaskError) and isinstance(e.cause, DFlashError):
                        raise e.cause from None  # bad input or settings: a restart would fail the same way
                    # an actor died, or a rank raised (out of memory): the others may wait in an
                    # collective; every stream actor is stopped and the run goes on from its checkpoint
                    self.restarts += 1
                    self.failed_at = self.failed_at or time.perf_counter()
                    self.failures.append(f"step {self.step + 1}: {failure_cause(e)}")
                    self._salvage()
                    self._note_lost_nodes()
                    if self.lost_since is None:  # a failure while redoing steps: still the first one's loss
                        self.lost_since = (self.step, time.perf_counter())
                    if self.restarts > self.cfg.train.max_restarts:
                        raise DFlashError(
                            f"a stream failed {self.restarts} times, over the budget of "
                            f"{self.cfg.train.max_restarts} restarts; last: {failure_cause(e)}",
                            field="train.max_restarts",
                        ) from None
                finally:
                    self._stop_actors()
        finally:
            self.trackers.finish()
        for team in self.teams:  # the run's whole history in one file, once (`history`)
            history.write_whole(team.output, team.metrics)
        summaries = [self._summary(team) for team in self.teams]
        steps_fewer = [
            m["step"] for m in self.metrics if m.get("streams", self.cfg.train.num_streams) < self.cfg.train.num_streams
        ]
        run = {
            "stage": "train",
            "output": self.output,
            "step": self.step,
            "total_steps": self.total_steps,
            "restarts": self.restarts,
            "failures": self.failures,
            "resumed_from": self.resumed_from,
            "slow_target_kernels": self.slow_kernels,
            "seconds_lost": round(self.seconds_lost, 1),
            "restart_seconds": self.restart_seconds,
            "streams": self.streams,
            "lost_nodes": self.lost_nodes,
            "steps_on_fewer_streams": len(steps_fewer),
            "deadlines_missed": self.deadlines.missed,
            "warm_up": self.warm,
            "samples": self._samples_taken(),
            "coordinator_node": ray.util.get_node_ip_address(),
            "stream_nodes": sorted(self.stream_nodes),
            "seconds": round(time.perf_counter() - started, 1),
            "trackers": tracked,
        }
        if self.cfg.train.drafters:  # each drafter's figures under its name
            return {**run, "drafters": {team.name: s for team, s in zip(self.teams, summaries)}}
        return {**run, **summaries[0]}

    def _summary(self, team: Team) -> dict[str, Any]:
        last = team.metrics[-1] if team.metrics else {}
        heldout = [m for m in team.metrics if m.get("heldout_tau") is not None]
        ratios = [m["straggler_ratio"] for m in team.metrics if "straggler_ratio" in m]
        return {
            "output": team.output,
            "loss": last.get("loss"),
            "tau": last.get("tau"),
            "straggler_ratio": round(sum(ratios) / len(ratios), 3) if ratios else None,
            "read_bytes": sum(m.get("read_bytes", 0) for m in team.metrics),
            "rendezvous": f"{team.rendezvous[0]}:{team.rendezvous[1]}" if team.rendezvous else None,
            "heldout_tau": heldout[-1]["heldout_tau"] if heldout else None,
            "heldout_tau_first": heldout[0]["heldout_tau"] if heldout else None,
            "heldout_tau_start": team.heldout_start,
            "checkpoint": checkpoint.step_dir(team.output, self.step),
        }

    def _warm_up(self) -> None:
        """Every graph shape of the run met before step 0, on every drafter rank together
        (`DrafterWorker.warm_up`), with torch's compiled artifacts kept with the run's output so
        that a restart loads them rather than compiling again."""
        from dflash_ray.train import compile_cache

        if not self.shapes:
            return
        started = time.perf_counter()
        # a compile a shape (tens of seconds at the real width on a GPU): the floor per 16 of them
        limit = self.deadlines.floor_s * (1 + len(self.shapes) / 16)
        done = self._wait(
            [
                d.warm_up.remote(self.shapes, compile_cache.uri_for(team.output))
                for team in self.teams
                for d in team.drafters
            ],
            self._names(self.all_drafters),
            f"the warm-up of {len(self.shapes)} graph shapes",
            limit,
        )
        self.warm.append(
            {
                "shapes": len(self.shapes),
                "seconds": round(time.perf_counter() - started, 1),
                "loaded_bytes": max(d["loaded_bytes"] for d in done),
            }
        )

    def _samples_taken(self) -> dict[str, int]:
        """How often each training sample was taken by the steps this coordinator ran (those a
        restart took again counted once): a run of whole epochs takes each of them `epochs` times,
        whatever number of streams each step ran on."""
        import collections

        counts = collections.Counter(x for samples in self.taken.values() for x in samples)
        return {
            "steps": len(self.taken),
            "taken": sum(counts.values()),
            "distinct": len(counts),
            "of": len(self.train_samples),
            "min_times": min(counts.values(), default=0),
            "max_times": max(counts.values(), default=0),
        }

    def _note_lost_nodes(self) -> None:
        """Name the nodes the streams ran on that have left the cluster (once each)."""
        named = {x["node"] for x in self.lost_nodes}
        for node in elastic.lost_nodes(self.stream_nodes):
            if node not in named:
                self.lost_nodes.append({"node": node, "at_step": self.step + 1})

    def stop(self) -> None:
        """Stop the stream actors and free their placement groups now (the driver was interrupted):
        a placement group outlives the actor that made it until its job ends, and would hold the
        resources a resume in the same driver asks for. The run does not restart them."""
        self.stopping = True
        self._stop_actors()

    def progress(self, since: int = 0) -> dict[str, Any]:
        """Where the run stands, and the first drafter's metric rows from index `since` on."""
        return {
            "step": self.step,
            "total_steps": self.total_steps,
            "restarts": self.restarts,
            "last": self.metrics[-1] if self.metrics else None,
            "rows": self.metrics[since:],
            "count": len(self.metrics),
            "streams": self.streams,
            "begun_at": self.begun_at,
        }
