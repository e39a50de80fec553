"""`dflash-ray generate`: every prompt answered by the target itself, by a pool of generator actors.

The driver splits the prompt shards into work units of `generate.shard_size` prompts, starts the
`ShardPool` (named, so `dflash-ray scale` / `status` reach it) and as many generator actors as the
pool's target, and then only reconciles: it starts generators when the target grows or one died
(its shard went back to the queue), asks the newest to drain when it shrinks, kills a generator
whose lease timed out, and fails once more than `max_restarts` generators died. Each generator
writes its shard's files itself (tokens never cross the object store), then reports to the pool.

Failures a restart would repeat stop the run at once, with the cause in the error: a generator whose
own code fails before it asks for its first shard (its engine did not start; one killed from outside
is replaced), two generators that raise the same error (figures aside), or an engine still starting
after `lease_timeout_s`.

Restart: `_progress.json` lists finished shards; a rerun with the same prompts and shard size
skips them, and a rerun of a finished job starts no actor at all. The output is a dataset only once
`_manifest.json` (written last) lists the winning file of every shard.

Why a pool of our own rather than `ray.data.llm` (`build_processor`): the stage needs live scaling
by command while the job runs, shard leases that survive a killed actor without redoing finished
work, per-prompt rejects with reasons, and token ids written as the engine saw them; Ray Data's
LLM processor scales only inside a fixed range chosen at start, and its checkpointing is reported
to deadlock on clusters of 4 CPUs or fewer, like the 2-core machines this runs on in CI.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import os
import re
import time
from typing import Any

from dflash_ray import manifest, storage, writer
from dflash_ray.cluster import connect, on_node
from dflash_ray.config import GenerateConfig, RunConfig, check_lengths
from dflash_ray.errors import DFlashError, DiskFull, failure_cause
from dflash_ray.generation.leases import PROGRESS
from dflash_ray.registry import pin
from dflash_ray.generation.options import check_model, engine_options
from dflash_ray.stages import PipelineRun, Stage

log = logging.getLogger(__name__)


def plan_units(files: list[str], shard_size: int) -> list[dict[str, Any]]:
    """Work units (file, first row, row count) over the prompt shards, in a fixed order."""
    from dflash_ray.arrow_files import open_parquet

    if shard_size < 1:
        raise DFlashError(f"must be >= 1, got {shard_size}", field="generate.shard_size")
    units: list[dict[str, Any]] = []
    for uri in files:
        fs, path = storage.arrow_filesystem(uri)
        with fs.open_input_file(path) as f:
            rows = open_parquet(f, uri).metadata.num_rows  # refused here, before any generator reads a row
        for start in range(0, rows, shard_size):
            units.append({"index": len(units), "uri": uri, "start": start, "count": min(shard_size, rows - start)})
    return units


def _plan(prompts_uri: str, units: list[dict[str, Any]], model: str, cfg: GenerateConfig) -> dict[str, str]:
    """What makes finished shards reusable, part by part: the prompts' content (not their path or file
    names: a pipeline rerun on new inputs rewrites the same file names), the units, model and sampling."""

    def digest(body: Any) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return {
        "prompts": manifest.fingerprint(prompts_uri),
        "model": model,
        "shards": digest([(storage.basename(u["uri"]), u["start"], u["count"]) for u in units]),
        "sampling": digest(
            [
                cfg.temperature,
                cfg.top_p,
                cfg.max_tokens,
                cfg.seed,
                cfg.enable_thinking,
                cfg.chat_template_kwargs,
                cfg.backend,
                cfg.samples_per_prompt,
            ]
        ),
    }


PLAN_PARTS = {
    "prompts": "the prompts' content (--prompts was rewritten since)",
    "model": "the model",
    "shards": "the shard size (generate.shard_size)",
    "sampling": "the sampling settings (generate.temperature, top_p, max_tokens, seed, thinking, backend, "
    "samples_per_prompt)",
}


def read_progress(output: str) -> dict[str, Any] | None:
    uri = storage.join(output, PROGRESS)
    try:
        progress = json.loads(storage.read_text(uri))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise DFlashError(
            f"corrupt generation progress ({e}); delete it to generate every shard again", file=uri
        ) from None
    if (
        not isinstance(progress, dict)
        or not isinstance(progress.get("done"), dict)
        or not all(
            isinstance(e, dict) and {"completions", "rows", "prompts"} <= set(e) for e in progress["done"].values()
        )
    ):
        raise DFlashError(
            "not a generation progress file (a mapping with `done` shards); delete it to generate every shard again",
            file=uri,
        )
    for index, entry in progress["done"].items():  # the shard files it names: read, copied, deleted
        for key in ("completions", "rejected"):
            if key in entry:
                storage.inside(output, entry[key], file=uri, field=f"done.{index}.{key}")
    return progress


def _finished_shards(output: str, plan: dict[str, str]) -> dict[int, dict[str, Any]]:
    progress = read_progress(output)
    if progress is None:
        return {}
    held = progress.get("plan")
    if held != plan:
        changed = [PLAN_PARTS[k] for k in plan if not isinstance(held, dict) or held.get(k) != plan[k]]
        raise DFlashError(
            f"holds a generation made with other inputs; changed: {'; '.join(changed)}. Its shards "
            "would not answer these prompts: choose another --output or delete this one",
            file=storage.join(output, PROGRESS),
        )
    done = {}
    for index, entry in progress["done"].items():  # a shard whose file is gone is generated again
        if storage.exists(storage.join(output, entry["completions"])):
            done[int(index)] = entry
    return done


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


POOL_TIMEOUT_S = 120.0  # a call to the pool actor; it answers at once unless it is gone


def same_error(cause: str) -> str:
    """What two failures share when they are the same error: the text without its figures and ids."""
    return re.sub(r"\d+(?:\.\d+)?", "#", cause)


class _Fleet:
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


def _check_samples(gcfg: GenerateConfig) -> None:
    if gcfg.samples_per_prompt < 1 or (gcfg.samples_per_prompt > 1 and gcfg.temperature <= 0):
        raise DFlashError(
            f"{gcfg.samples_per_prompt} samples per prompt need at least one, and more than one "
            "needs temperature > 0 (greedy samples are all the same)",
            field="generate.samples_per_prompt",
        )


def _refuse_same_name(ray, gcfg: GenerateConfig) -> None:
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


def _run_fleet(
    units: list[dict[str, Any]],
    done: dict[int, dict[str, Any]],
    todo: list[dict[str, Any]],
    model: str,
    cfg: RunConfig,
    output: str,
    plan: dict[str, str],
    progress: bool,
) -> tuple[dict[str, Any], dict[int, dict[str, Any]], _Fleet]:
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
    fleet = _Fleet(pool, model, gcfg, output)
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


def run_generate(prompts_uri: str, output: str, model: str, cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    import ray

    gcfg = cfg.generate
    _check_samples(gcfg)
    storage.require_folder(output)
    length_warning = check_lengths(cfg)
    if length_warning:
        log.warning(length_warning)
    started = time.time()
    manifest.require_columns(prompts_uri, ["messages"], "--prompts (a prompts dataset)")  # before any engine starts
    units = plan_units(manifest.dataset_files(prompts_uri, (".parquet",)), gcfg.shard_size)
    model = pin(model)  # a Hub id: the commit every generator reads, recorded in the manifest
    plan = _plan(prompts_uri, units, model, gcfg)
    done = _finished_shards(output, plan)
    todo = [u for u in units if u["index"] not in done]
    summary = {
        "stage": "generate",
        "output": output,
        "model": model,
        "backend": gcfg.backend,
        "shards": len(units),
        "shards_run": len(todo),
        "length_warning": length_warning,
    }
    committed = manifest.read_manifest(output) is not None
    if not todo and committed:
        return _nonempty(
            {
                **summary,
                **_totals(done),
                "generators_started": 0,
                "restarts": 0,
                "seconds": round(time.time() - started, 1),
                "tokens_per_s": None,
            },
            output,
        )
    if todo:
        check_model(model)
    connect(cfg.ray)
    check_room(gcfg, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    with writer.claim(output, "completions") as held:  # one run writes here; another is refused
        if committed:  # the old dataset stops being complete now
            storage.delete(storage.join(output, manifest.MANIFEST))
        _refuse_same_name(ray, gcfg)
        final, done, fleet = _run_fleet(units, done, todo, model, cfg, output, plan, progress)
        summary.update(
            _totals(done),
            generators_started=fleet.started,
            restarts=fleet.restarts,
            deaths=fleet.deaths,
            seconds=round(time.time() - started, 1),
            tokens_per_s=final["tokens_per_s"],
            tokens_generated=final["tokens_generated"],
            generators_peak=final["generators_peak"],
            autoscaled=gcfg.autoscale.enabled,
            seconds_lost=final["seconds_lost"],
        )
        held.check()
        _commit(output, units, done, summary, cfg)
        return _nonempty(summary, output)


def _nonempty(summary: dict[str, Any], output: str) -> dict[str, Any]:
    """The summary of a generation that kept some answer; none kept is an error (nothing to train on).
    Prompts longer than the target's context were never decoded: said here, and counted."""
    too_long = summary["rejected_kinds"].get("prompt_too_long", 0)
    if too_long:
        log.warning(
            "%d prompts were longer than the target's context (generate.max_model_len, or the model's positions "
            "when fewer): not generated; each is in %s with kind prompt_too_long",
            too_long,
            storage.join(output, manifest.REJECTED),
        )
    if summary["completions"] == 0:
        kinds = ", ".join(f"{k}: {v}" for k, v in summary["rejected_kinds"].items()) or "none counted"
        raise DFlashError(
            f"no completions: every one of {summary['rejected']} answers was rejected ({kinds}); "
            "see the rejected file. Answers cut at generate.max_tokens are rejected unless "
            "generate.truncated=keep",
            file=output,
        ).with_summary(summary)
    return summary


def _totals(done: dict[int, dict[str, Any]]) -> dict[str, Any]:
    kinds: collections.Counter[str] = collections.Counter()
    for entry in done.values():
        kinds.update({k: v for k, v in entry["counts"].items() if k not in ("completions", "rejected")})
    return {
        "prompts": sum(e["prompts"] for e in done.values()),
        "completions": sum(e["rows"] for e in done.values()),
        "rejected": sum(e["counts"]["rejected"] for e in done.values()),
        "rejected_kinds": {
            k: v for k, v in sorted(kinds.items()) if k not in ("truncated_kept", "conversations_cut") and v
        },
        "truncated_kept": kinds.get("truncated_kept", 0),
        "conversations_cut": kinds.get("conversations_cut", 0),
        "output_tokens": sum(e["output_tokens"] for e in done.values()),
        "generator_nodes": sorted({e["node"] for e in done.values() if e.get("node")}),
    }


def _commit(
    output: str, units: list[dict[str, Any]], done: dict[int, dict[str, Any]], summary: dict[str, Any], cfg: RunConfig
) -> None:
    """Write the manifest of the winning files (and the merged rejects); delete every other file."""
    missing = [u["index"] for u in units if u["index"] not in done]
    if missing:
        raise DFlashError(f"shards {missing[:10]} never finished", file=output)
    entries = [
        {
            "name": done[u["index"]]["completions"],
            "rows": done[u["index"]]["rows"],
            **{k: done[u["index"]][k] for k in ("bytes", "sha256") if k in done[u["index"]]},
        }
        for u in units
    ]
    keep = {e["name"] for e in entries} | {done[u["index"]]["rejected"] for u in units}
    rejected = "".join(storage.read_text(storage.join(output, done[u["index"]]["rejected"])) for u in units)
    storage.write_text(storage.join(output, manifest.REJECTED), rejected)
    for uri in storage.list_files(output, (".parquet", ".jsonl")):
        name = storage.basename(uri)
        if name.startswith(("completions-", "rejected-")) and name not in keep:
            storage.delete(uri)
    manifest.write_manifest(output, kind="completions", files=entries, summary=summary, config=cfg.to_dict())


def _pool(cfg: RunConfig):
    import ray

    from dflash_ray.generation.actors import NAMESPACE

    def named():
        try:
            return ray.get_actor(cfg.generate.name, namespace=NAMESPACE)
        except ValueError:
            return None

    # on this machine: the cluster that runs the generation of this name, of those running here
    connect(cfg.ray, existing=True, holds=lambda: named() is not None)
    pool = named() if ray.is_initialized() else None
    if pool is None:
        where = (
            "on the cluster at ray.address (or RAY_ADDRESS)"
            if cfg.ray.address or os.environ.get("RAY_ADDRESS")
            else "on this machine (the clusters local runs started, and `ray start`'s); set ray.address or "
            "RAY_ADDRESS for another machine's"
        )
        raise DFlashError(f"no generation named {cfg.generate.name!r} is running {where}", field="generate.name")
    return pool


def scale(n: int, cfg: RunConfig) -> dict[str, Any]:
    """Set the number of generator actors of a running generation (`dflash-ray scale generators N`)."""
    import ray

    if n < 0:
        raise DFlashError(f"must be >= 0, got {n}", field="generators")
    status = ray.get(_pool(cfg).set_target.remote(n), timeout=POOL_TIMEOUT_S)
    if status.get("bounded"):
        log.warning("%s", status["bounded"])
    return {"stage": "scale", "name": cfg.generate.name, **status}


def pause(paused: bool, cfg: RunConfig) -> dict[str, Any]:
    """Pause a running generation (`dflash-ray pause`: generators finish the shard they hold and
    wait, engines loaded) or resume it (`dflash-ray resume`)."""
    import ray

    status = ray.get(_pool(cfg).pause.remote(paused), timeout=POOL_TIMEOUT_S)
    return {"stage": "resume" if not paused else "pause", "name": cfg.generate.name, **status}


def status(cfg: RunConfig, output: str | None = None) -> dict[str, Any]:
    """A running generation's figures from its pool; or, with `output`, a stopped one's from storage."""
    import ray

    if output is not None:
        progress = read_progress(output)
        if progress is None:
            raise DFlashError("no generation progress here", file=storage.join(output, PROGRESS))
        done = {int(k): v for k, v in progress["done"].items()}
        info = manifest.read_manifest(output)
        return {
            "stage": "status",
            "output": output,
            "complete": info is not None,
            "shards_done": len(done),
            **_totals(done),
        }
    return {"stage": "status", "name": cfg.generate.name, **ray.get(_pool(cfg).status.remote(), timeout=POOL_TIMEOUT_S)}


def _named(cfg: RunConfig, name: str | None) -> RunConfig:
    import dataclasses

    return cfg if name is None else dataclasses.replace(cfg, generate=dataclasses.replace(cfg.generate, name=name))


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    import dataclasses

    changes = {k: v for k, v in (("generators", args.generators), ("name", args.name)) if v is not None}
    cfg = dataclasses.replace(cfg, generate=dataclasses.replace(cfg.generate, **changes))
    return run_generate(args.prompts, args.output, args.model, cfg, progress=not args.json)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, metavar="URI", help="prompt shards (from `dflash-ray prompts`)")
    p.add_argument("--output", required=True, metavar="URI")
    p.add_argument("--model", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--generators", type=int, metavar="N", help="generator actors at the start (generate.generators)")
    p.add_argument("--name", help="run name that scale and status use (generate.name)")


def _step(run: PipelineRun) -> dict[str, Any] | None:
    """The target answers the prompts trained on (not with `pipeline.responses`: those are answered)."""
    if run.cfg.pipeline.responses:
        return None
    at, cfg = run.at, run.cfg
    generated = run.timed(
        "generate",
        run_generate,
        at("prompts-train"),
        at("completions"),
        cfg.pipeline.target,
        cfg,
        progress=run.progress,
    )
    run.results["generate"] = generated
    return {
        "completions": generated["completions"],
        "generation_rejected": generated["rejected_kinds"],
        "generator_nodes": generated["generator_nodes"],
        "generated_tokens": generated["output_tokens"],
        "generate_tokens_per_s": generated["tokens_per_s"],
        "length_warning": generated.get("length_warning"),
    }


def _name_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", help="the generation's name (generate.name)")


def _scale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["generators"])
    p.add_argument("count", type=int, metavar="N")
    _name_argument(p)


def _status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", help="a running generation's name (generate.name)")
    p.add_argument("--output", metavar="URI", help="read a stopped or finished generation's progress from here")


STAGES = (
    Stage(
        name="generate",
        help="regenerate every response with the target itself",
        command=_command,
        arguments=_arguments,
        section="generate",
        order=20,
        inputs=("prompts-train",),
        outputs=("completions",),
        step=_step,
    ),
    Stage(
        name="scale",
        help="change the generator count of a running generation",
        command=lambda args, cfg: scale(args.count, _named(cfg, args.name)),
        arguments=_scale_arguments,
        section="generate",
        order=21,
    ),
    Stage(
        name="pause",
        help="pause or resume a running generation: generators finish their shard and wait, engines loaded",
        command=lambda args, cfg: pause(True, _named(cfg, args.name)),
        arguments=_name_argument,
        section="generate",
        order=22,
    ),
    Stage(
        name="resume",
        help="pause or resume a running generation: a paused generation goes on",
        command=lambda args, cfg: pause(False, _named(cfg, args.name)),
        arguments=_name_argument,
        section="generate",
        order=23,
    ),
    Stage(
        name="status",
        help="progress of a generation: shards, generators, tokens/s, ETA",
        command=lambda args, cfg: status(_named(cfg, args.name), args.output),
        arguments=_status_arguments,
        section="generate",
        order=24,
    ),
)
