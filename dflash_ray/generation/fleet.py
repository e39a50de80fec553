"""The generation driver's side of the pool: the generator actors it starts and stops, and the loop
that follows the pool until every shard is done.

The driver only reconciles: it starts generators when the pool's target grows or one died (its
shard went back to the queue), the pool asks the newest to drain when it shrinks, and a generator
whose lease timed out is killed and replaced. Failures a restart would repeat stop the run at once,
with the cause in the error: a generator whose own code fails before it asks for its first shard
(its engine did not start; one killed from outside is replaced), two generators that raise the same
error (figures aside), a full disk, or an engine still starting after `lease_timeout_s`; otherwise
the run fails once more than `max_restarts` generators died.

Also here, what the driver settles with the cluster before it starts the pool: that one node can
hold a generator (`check_room`), that no generation of the same name runs, and the autoscaler's
request for the generators' bundles (`request_nodes`). Ray is imported only inside the functions.
"""

from __future__ import annotations

import re
import time
from typing import Any

from dflash_ray.cluster import on_node
from dflash_ray.config import GenerateConfig, RunConfig
from dflash_ray.errors import DFlashError, DiskFull, failure_cause
from dflash_ray.generation.options import engine_options

POOL_TIMEOUT_S = 120.0  # a call to the pool actor; it answers at once unless it is gone


def check_room(cfg: GenerateConfig, nodes: list[dict[str, float]]) -> None:
    """Refuse, before any actor starts, a generator that no node of the cluster can ever hold (its
    engine would wait for resources that never come). Skipped with autoscaling: nodes may be added."""
    options = engine_options(cfg)
    need = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **(options["resources"] or {})}
    need = {k: v for k, v in need.items() if v}
    if cfg.autoscale.enabled or any(all(n.get(k, 0.0) >= v for k, v in need.items()) for n in nodes):
        return
    asked = ", ".join(f"{v:g} {k}" for k, v in sorted(need.items()))
    have = "; ".join(", ".join(f"{n.get(k, 0.0):g} {k}" for k in sorted(need)) for n in nodes) or "no node"
    raise DFlashError(
        f"one generator needs {asked} on one node; the cluster's nodes have {have}: no node can "
        "hold it. Lower generate.generator_cpus (or generator_gpus), or add a node that can",
        field="generate.generator_cpus",
    )


def request_nodes(cfg: GenerateConfig, generators: int) -> None:
    """Ask the Ray autoscaler for room for `generators` engines (their bundles), so that it adds
    nodes before the actors queue and lets idle ones go once the count drops; 0 withdraws the ask."""
    from ray.autoscaler.sdk import request_resources

    options = engine_options(cfg)  # the very resources each generator actor asks for
    bundle = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options["resources"]}
    request_resources(bundles=[{k: v for k, v in bundle.items() if v}] * generators)


def refuse_same_name(ray, gcfg: GenerateConfig) -> None:
    """Two generations of one name would share one pool (the pool is found by its name)."""
    from dflash_ray.generation.actors import NAMESPACE

    try:
        ray.get_actor(gcfg.name, namespace=NAMESPACE)
        raise DFlashError(
            f"a generation named {gcfg.name!r} is running on this cluster; set another generate.name",
            field="generate.name",
        )
    except ValueError:
        pass


def same_error(cause: str) -> str:
    """What two failures share when they are the same error: the text without its figures and ids."""
    return re.sub(r"\d+(?:\.\d+)?", "#", cause)


class Fleet:
    """The driver's generator actors: start, drain, notice deaths, and stop the run on a failure
    that restarting would repeat."""

    def __init__(self, pool, model: str, cfg: GenerateConfig, output: str):
        import ray

        from dflash_ray.generation.actors import NAMESPACE, Generator

        self.pool, self.model, self.cfg, self.output = pool, model, cfg, output
        self.cls: Any = Generator  # Ray's typing of a `@ray.remote` class has no `.options`
        self.options = {**engine_options(cfg), "namespace": NAMESPACE}
        self.running: dict[Any, tuple[str, Any]] = {}  # run ref -> (generator id, actor)
        self.started_at: dict[str, float] = {}
        self.started = self.restarts = 0
        self.deaths: list[str] = []
        self.errors: dict[str, str] = {}  # same_error(cause) -> the generator that raised it first
        self.killed: set[str] = set()
        self.ray = ray

    def start(self, n: int) -> None:
        for _ in range(n):
            gid = f"g{self.started}"
            self.started += 1
            actor = self.cls.options(name=f"{self.cfg.name}-{gid}", **self.options).remote(
                gid, self.model, self.cfg, self.output, self.pool
            )
            self.ray.get(self.pool.register.remote(gid), timeout=POOL_TIMEOUT_S)
            self.started_at[gid] = time.monotonic()
            self.running[actor.run.remote()] = (gid, actor)

    def kill(self, gids: list[str]) -> None:
        for ref, (gid, actor) in list(self.running.items()):
            if gid in gids:
                self.killed.add(gid)
                self.ray.kill(actor)

    def check_starting(self, starting: list[str]) -> None:
        """A generator whose engine has not asked for work within `lease_timeout_s` is stuck starting."""
        now = time.monotonic()
        for gid in starting:
            waited = now - self.started_at.get(gid, now)
            if waited > self.cfg.lease_timeout_s:
                self.stop()
                raise DFlashError(
                    f"generator {gid} did not start its engine in {waited:.0f} s; see its actor log",
                    field="generate.lease_timeout_s",
                )

    def poll(self, timeout: float, *, final: bool = False) -> None:
        """Wait up to `timeout` for generators to end; a dead one's shard goes back to the queue.
        Raises on a failure that a restart would repeat, or past `max_restarts` (not once all is done)."""
        from ray.exceptions import RayActorError, RayTaskError

        if not self.running:
            time.sleep(timeout)
            return
        ready, _ = self.ray.wait(list(self.running), num_returns=len(self.running), timeout=timeout)
        fatal = None
        for ref in ready:
            gid, _ = self.running.pop(ref)
            error = None
            try:
                self.ray.get(ref)
            except Exception as e:  # the actor died (killed, OOM, node lost) or its code raised
                error = e
            _, had_started = self.ray.get(self.pool.exited.remote(gid), timeout=POOL_TIMEOUT_S)
            if error is None:
                continue
            self.restarts += 1
            cause = failure_cause(error)
            self.deaths.append(f"{gid}: {cause}")
            raised = isinstance(error, RayTaskError) or (isinstance(error, RayActorError) and error.actor_init_failed)
            if isinstance(error, RayTaskError) and isinstance(error.cause, DiskFull):  # every restart would meet it
                fatal = fatal or f"generator {gid}: {error.cause}"
            elif not had_started and raised and gid not in self.killed:  # its own code failed: it would again
                fatal = fatal or f"generator {gid} failed before its first shard: {cause}"
            elif raised and gid not in self.killed:
                first = self.errors.setdefault(same_error(cause), gid)
                if first != gid:
                    fatal = fatal or f"generators {first} and {gid} failed with the same error: {cause}"
        if final:
            return
        if fatal:
            self.stop()
            raise DFlashError(f"{fatal} (stopped at once: restarting would fail the same way)")
        if self.restarts > self.cfg.max_restarts:
            self.stop()
            raise DFlashError(
                f"{self.restarts} generator actors died (max_restarts {self.cfg.max_restarts}); "
                f"last: {self.deaths[-1]}",
                field="generate.max_restarts",
            )

    def stop(self) -> None:
        for _, actor in self.running.values():
            self.ray.kill(actor)
        self.running.clear()


def follow_pool(
    units: list[dict[str, Any]],
    done: dict[int, dict[str, Any]],
    todo: list[dict[str, Any]],
    model: str,
    cfg: RunConfig,
    output: str,
    plan: dict[str, str],
    progress: bool,
) -> tuple[dict[str, Any], dict[int, dict[str, Any]], Fleet]:
    """Start the pool and follow it until every shard is done: the driver only reconciles (see the
    module docstring). The pool's final status, the finished shards, and the fleet's counts. The
    actors are gone, and the autoscaler's request withdrawn, however this ends."""
    import ray
    from tqdm import tqdm

    from dflash_ray.generation.actors import NAMESPACE, ShardPool

    gcfg = cfg.generate
    pool_class: Any = ShardPool  # Ray's typing of a `@ray.remote(...)` class has no `.options`
    pool = pool_class.options(name=gcfg.name, namespace=NAMESPACE, resources=on_node(cfg.ray.head_resource)).remote(
        units, done, gcfg, output, plan
    )
    fleet = Fleet(pool, model, gcfg, output)
    asked = None  # the generator count the autoscaler was last asked to make room for
    total = sum(u["count"] for u in units)
    bar = tqdm(
        total=total,
        initial=total - sum(u["count"] for u in todo),
        desc="generate",
        unit=" prompts",
        disable=not progress,
    )
    try:
        while True:
            # drained generators stop by themselves; late ones are killed and replaced
            start_n, _, late = ray.get(pool.reconcile.remote(), timeout=POOL_TIMEOUT_S)
            fleet.kill(late)
            fleet.start(start_n)
            status = ray.get(pool.status.remote(), timeout=POOL_TIMEOUT_S)
            if status["autoscale"] and gcfg.autoscale.request_nodes and status["generators_target"] != asked:
                asked = status["generators_target"]
                request_nodes(gcfg, asked)
            bar.n = status["prompts_done"]
            bar.set_postfix(generators=status["generators_alive"], tok_s=status["tokens_per_s"])
            if status["finished"]:
                break
            fleet.check_starting(status["generators_starting"])
            fleet.poll(timeout=1.0)
        final = ray.get(pool.status.remote(), timeout=POOL_TIMEOUT_S)
        done = ray.get(pool.done.remote(), timeout=POOL_TIMEOUT_S)
        fleet.poll(timeout=5.0, final=True)  # idle generators return now that no shard is left
    except DFlashError as e:
        raise e.with_summary({"stage": "generate", "deaths": fleet.deaths})
    finally:
        bar.close()
        fleet.stop()
        ray.kill(pool)
        if asked:
            request_nodes(gcfg, 0)  # the nodes may go once idle
    return final, done, fleet
