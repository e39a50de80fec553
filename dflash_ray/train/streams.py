"""A run's stream actors: where they are placed, how they meet, how the coordinator waits on them.

A stream is a target actor and one drafter actor per drafter of the run (a `Team` is one drafter's
actors over the streams, with its own process group, checkpoints, metrics and output folder), or
with `train.colocate` one actor that is both. `Streams.start` places as many streams as the cluster
holds now (`elastic`: down to `train.min_streams`), starts their actors and joins them into their
process groups: with send/recv features (`handoff`) one group of every stream actor, its store on
target 0's node; otherwise one group per drafter, its store on drafter rank 0's node (as Ray Train
does). Every wait on them has a deadline (`deadlines`) and names the actors that miss it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, Sequence

from dflash_ray import progress
from dflash_ray.cluster import on_node
from dflash_ray.config import RunConfig
from dflash_ray.drafter.families import mask_and_layer_ids
from dflash_ray.train import elastic
from dflash_ray.train.deadlines import Deadlines, Stalled
from dflash_ray.train.devices import stream_bundles
from dflash_ray.train.drafters import union_layers
from dflash_ray.train import mesh
from dflash_ray.train.handoff import Layout
from dflash_ray.train.resolved import ResolvedDrafter
from dflash_ray.train.target_worker import TargetWorker
from dflash_ray.train.workers import ColocatedWorker, DrafterWorker

log = logging.getLogger(__name__)

CHECKPOINT_THREAD = "checkpoint"  # a drafter actor's concurrency group for its checkpoint files


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_of(_worker) -> str:
    """Run inside a stream actor (`__ray_call__`): the address of the node it runs on."""
    import ray

    return ray.util.get_node_ip_address()


def group_node(pg) -> str:
    """The address of the node a stream's placement group was given (its bundles share one node):
    known before any of its actors tells where it runs."""
    import ray
    from ray.util import placement_group_table

    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    given = [address.get(i, "?") for i in placement_group_table(pg)["bundles_to_node_id"].values()]
    return given[0] if given else "?"


def rendezvous_of(_worker) -> tuple[str, int]:
    """Run inside a group's first rank (`__ray_call__`): its node's address and a port free there,
    where its process group store will listen."""
    import ray

    return ray.util.get_node_ip_address(), free_port()


def drafter_actor(cls):
    """A drafter role as an actor that answers for its checkpoint files on a thread of its own
    (`Checkpoints.salvage`), its training calls still one at a time."""
    import ray

    return ray.remote(concurrency_groups={CHECKPOINT_THREAD: 1})(cls)


def first_error(refs: list) -> list:
    """The results of calls on several actors; a rank's error is raised as soon as it is known, while
    the other ranks may still wait for it in a collective."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(refs)


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


def make_teams(drafters: Sequence[ResolvedDrafter]) -> tuple[list[Team], list[int]]:
    """A `Team` for each drafter the driver resolved (its settings, shape, start and output folder);
    and the target layers to capture for them all (each team's `pick` among them)."""
    teams = [
        Team(d.name, d.cfg, json.dumps(d.serving), d.init, d.output, mask_and_layer_ids(d.serving)[1]) for d in drafters
    ]
    layer_ids, picks = union_layers([t.layer_ids for t in teams])
    for team, pick in zip(teams, picks):
        team.pick = pick
    return teams, layer_ids


class Streams:
    """The stream actors of one attempt of a run (`start` ... `stop`), and what outlives attempts:
    the nodes they ran on, the nodes lost, the deadlines missed."""

    def __init__(self, cfg: RunConfig, target: str, run_name: str, teams: list[Team], layer_ids: list[int]):
        self.cfg, self.target, self.run_name, self.teams, self.layer_ids = cfg, target, run_name, teams, layer_ids
        self.count = cfg.train.num_streams  # the streams placed now: num_streams, or fewer (`elastic`)
        self.targets: list[Any] = []  # actor handles
        self.groups: list[Any] = []  # placement groups
        self.pending: list[Any] = []  # those of lost streams, still asked for (`elastic`)
        self.idle: list[Any] = []  # placed, but beyond the mesh's balanced share (`mesh.balanced`)
        self.nodes: set[str] = set()  # every node a stream ran on, over restarts too
        self.lost: list[dict[str, Any]] = []  # nodes the streams ran on that left the cluster
        self.slow_kernels: list[str] = []  # fast kernels a hybrid target ran without (train.allow_slow_target)
        self.deadlines = Deadlines(cfg.train.deadline_floor_s, cfg.train.deadline_factor)
        # how the drafters hold their weights (`train/mesh.py`): the kind, and its rows of streams
        self.sharding = mesh.kind_of(cfg.train.layout)
        self.rows: list[list[int]] = []
        # each stream actor's Ray name (what its progress is published under) and its node's address
        self.keys: dict[Any, str] = {}
        self.placed_on: dict[Any, str] = {}

    @property
    def direct(self) -> bool:
        """Features go from a target to its drafters by send/recv (`handoff`), not as object references."""
        tcfg = self.cfg.train
        return not tcfg.colocate and tcfg.feature_transport == "direct"

    @property
    def layout(self) -> Layout:
        return Layout(self.count, len(self.teams), tuple(tuple(r) for r in self.rows))

    @property
    def drafters(self) -> list:
        """Every drafter actor, team by team."""
        return [d for team in self.teams for d in team.drafters]

    def names(self, actors: list) -> list[str]:
        """What the log and the metrics call each of these actors: its role and stream."""
        names = {a: f"target {s}" for s, a in enumerate(self.targets)}
        for team in self.teams:
            role = "stream" if self.cfg.train.colocate else f"drafter {team.name}".strip()
            names.update({a: f"{role} {s}" for s, a in enumerate(team.drafters)})
        return [names.get(a, "actor") for a in actors]

    def wait(
        self, refs: list, actors: list, what: str, limit_s: float | None = None, watch=None, progressing: bool = False
    ) -> list:
        """The results of calls on `actors` (one each, in order) under a deadline (`deadlines`): an
        error as soon as it is known, and an actor past the deadline named (a log line, the
        `dflash_train_stalls` counter). `progressing`: work that tells its progress (a start-up, a
        warm-up), each actor given `limit_s` to begin and then waited for while its own progress
        moves (`Deadlines.wait_progressing`): one that stops is named while the others still move."""
        try:
            if progressing:  # each actor's progress is published under its Ray name (`progress`)
                first_s = self.deadlines.floor_s if limit_s is None else limit_s
                keys = [self.keys[a] for a in actors]
                nodes = [self.placed_on[a] for a in actors]
                return self.deadlines.wait_progressing(refs, self.names(actors), what, first_s, keys, nodes)
            return self.deadlines.wait(refs, self.names(actors), what, limit_s, watch)
        except Stalled as e:
            self._count(e)
            raise

    def missed(self, what: str, actors: list, limit_s: float) -> None:
        """`actors` missed the deadline `limit_s` of `what`, waited for elsewhere: named and raised."""
        try:
            self.deadlines.miss(what, self.names(actors), limit_s)
        except Stalled as e:
            self._count(e)
            raise

    def _count(self, e: Stalled) -> None:
        from ray.util.metrics import Counter

        counter = Counter("dflash_train_stalls", description="actors that missed a deadline", tag_keys=("run",))
        counter.inc(len(e.late), tags={"run": self.run_name})

    def start(self, step: int) -> int:
        """Place the streams, start their actors and join them into their process groups; returns
        how many streams were placed. `step`: where the run stands (for the lost nodes' record)."""
        import ray

        tcfg = self.cfg.train
        self.targets, self.keys, self.placed_on = [], {}, {}
        for team in self.teams:
            team.drafters = []
        # as many streams as the cluster holds now, down to train.min_streams (`elastic`)
        asked = elastic.place_streams(tcfg, stream_bundles(tcfg))
        placed = elastic.placed(asked)
        self.pending = [g for g in asked if g not in placed]  # still asked for: the run grows back
        # hsdp's rows are one size: the streams beyond the largest balanced share stay placed, idle
        nodes = elastic.nodes_of(placed)
        floor, stand_in = tcfg.min_streams or tcfg.num_streams, tcfg.lost_streams == "stand_in"
        keep = mesh.training_ranks(self.sharding, nodes, tcfg.num_streams, floor, stand_in)
        self.groups = [placed[i] for i in keep]
        self.idle = [g for i, g in enumerate(placed) if i not in keep]
        self.count = n = len(self.groups)
        if self.idle:
            log.warning(
                "%d placed streams idle: %d train, the largest share of the placed ones in rows of one size",
                len(self.idle),
                n,
            )
        self.nodes |= {nodes[i] for i in keep if nodes[i]}
        self.note_lost(step)  # Ray may take seconds to call a node dead: named here if not at the failure
        for s, pg in enumerate(self.groups):
            self._start_stream(s, pg, n)
        # actors load their weights in their constructors: the start-up waits on each while its bytes
        # arrive (fetched, or read from the node's disk)
        actors = self.targets + self.drafters
        starting = self.deadlines.floor_s + tcfg.placement_timeout_s  # processes start, torch imports
        placed = self.wait(
            [a.__ray_call__.remote(node_of) for a in actors], actors, "start-up", starting, progressing=True
        )
        self.nodes.update(placed)
        # a stream's actors share a node: its first actor's (the target, or the colocated one) is the stream's
        self.rows = mesh.rows_of(self.sharding, placed[:n])
        # a hybrid target on its GPU without its fast kernels: refused now, not found slow in hour five
        probed = self.drafters if tcfg.colocate else self.targets
        missing = self.wait([a.kernels.remote() for a in probed], probed, "the kernel check")
        self.slow_kernels = sorted({k for m in missing for k in m})
        if self.direct:  # one process group of every stream actor: features by send/recv
            rendezvous = ray.get(self.targets[0].__ray_call__.remote(rendezvous_of), timeout=self.deadlines.limit())
            layout = self.layout
            self.wait(
                [t.join_run.remote(*rendezvous, s, layout) for s, t in enumerate(self.targets)]
                + [
                    d.join_run.remote(*rendezvous, i, layout)
                    for i, team in enumerate(self.teams)
                    for d in team.drafters
                ],
                self.targets + self.drafters,
                "joining the run's process group",
            )
            for team in self.teams:
                team.rendezvous = rendezvous
        else:
            for team in self.teams:  # each drafter's ranks form a process group of their own
                team.rendezvous = ray.get(
                    team.drafters[0].__ray_call__.remote(rendezvous_of), timeout=self.deadlines.limit()
                )
                self.wait(
                    [d.init_group.remote(*team.rendezvous, self.rows) for d in team.drafters],
                    team.drafters,
                    "joining the drafters' process group",
                )
        return n

    def _start_stream(self, s: int, pg, n: int) -> None:
        """Stream `s`'s actors in its placement group; their settings say how many streams there are
        now (sharding, the process group)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        tcfg = dataclasses.replace(self.cfg.train, num_streams=n)
        bundles = stream_bundles(tcfg)
        node = group_node(pg)
        named: list[str] = []

        def at(index: int, role: str) -> dict:
            named.append(f"{self.run_name}-{role}-{s}")
            # what an actor of an earlier attempt under this name told is not the new one's
            progress.forget(named[-1:])
            return {
                "num_cpus": tcfg.actor_cpus,
                "num_gpus": bundles[index].get("GPU", 0),
                "resources": on_node(tcfg.node_resource),
                "name": named[-1],
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            }

        if tcfg.colocate:  # the stream's one actor is its target and its drafter
            team = self.teams[0]
            settings = dataclasses.replace(team.cfg.train, num_streams=n)
            team.drafters.append(
                drafter_actor(ColocatedWorker)
                .options(**at(0, "stream"))
                .remote(self.target, self.layer_ids, team.drafter_cfg_json, team.init, settings, s, n, team.pick)
            )
            started = [team.drafters[-1]]
        else:
            self.targets.append(
                ray.remote(TargetWorker).options(**at(0, "target")).remote(self.target, self.layer_ids, tcfg)
            )
            for i, team in enumerate(self.teams):
                role = f"drafter-{team.name}" if team.name else "drafter"
                settings = dataclasses.replace(team.cfg.train, num_streams=n)
                team.drafters.append(
                    drafter_actor(DrafterWorker)
                    .options(**at(1 + i, role))
                    .remote(self.target, team.drafter_cfg_json, team.init, settings, s, n, team.pick)
                )
            started = [self.targets[-1]] + [team.drafters[-1] for team in self.teams]
        for actor, name in zip(started, named):
            self.keys[actor], self.placed_on[actor] = name, node

    def warm_up(self, shapes: list[tuple[int, int, bool]]) -> dict[str, Any]:
        """Every graph shape of the run met before step 0, on every drafter rank together
        (`DrafterWorker.warm_up`), torch's compiled artifacts kept with each drafter's output so
        that a restart loads them rather than compiling again."""
        import time

        from dflash_ray.train import compile_cache

        started = time.perf_counter()
        # a compile a shape (tens of seconds at the real width on a GPU): waited for while shapes are met
        done = self.wait(
            [
                d.warm_up.remote(shapes, compile_cache.uri_for(team.output))
                for team in self.teams
                for d in team.drafters
            ],
            self.drafters,
            f"the warm-up of {len(shapes)} graph shapes",
            progressing=True,
        )
        return {
            "shapes": len(shapes),
            "seconds": round(time.perf_counter() - started, 1),
            "loaded_bytes": max(d["loaded_bytes"] for d in done),
        }

    def grown(self) -> int:
        """Streams the run would gain were it started again now: the lost ones' placement groups,
        asked for since the start, placed, with the idle ones, on a mesh still balanced
        (`mesh.balanced`): the run grows back at its next checkpoint."""
        back = elastic.placed(self.pending)
        if not back:
            return 0
        every = elastic.nodes_of(self.groups + self.idle + back)
        tcfg = self.cfg.train
        wider = mesh.balanced(self.sharding, every, tcfg.num_streams, tcfg.lost_streams == "stand_in")
        return max(0, len(wider) - self.count)

    def note_lost(self, step: int) -> None:
        """Name the nodes the streams ran on that have left the cluster (once each)."""
        named = {x["node"] for x in self.lost}
        for node in elastic.lost_nodes(self.nodes):
            if node not in named:
                self.lost.append({"node": node, "at_step": step + 1})

    def stop(self) -> None:
        """Kill every stream actor and free the placement groups."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.targets + self.drafters:
            ray.kill(actor)
        for pg in self.groups + self.idle + self.pending:
            remove_placement_group(pg)
        self.targets, self.groups, self.idle, self.pending = [], [], [], []
        for team in self.teams:
            team.drafters = []
