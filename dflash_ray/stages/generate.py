"""`dflash-ray generate`: every prompt answered by the target itself, by a pool of generator actors.

The driver splits the prompt shards into work units of `generate.shard_size` prompts, starts the
`ShardPool` (named, so `dflash-ray scale` / `status` reach it) and as many generator actors as the
pool's target, and then only reconciles: it starts generators when the target grows or one died
(its shard went back to the queue), asks the newest to drain when it shrinks, kills a generator
whose lease timed out, and fails once more than `max_restarts` generators died. Each generator
writes its shard's files itself (tokens never cross the object store), then reports to the pool.

Failures a restart would repeat stop the run at once, with the cause in the error (the fleet and
its rules: `generation/fleet.py`). Restart: `_progress.json` lists finished shards; a rerun with the
same prompts and shard size skips them, and a rerun of a finished job starts no actor at all. The
output is a dataset only once `_manifest.json` (written last) lists the winning file of every shard
(the shards on storage: `generation/shards.py`). This module holds the commands: `generate`, and
`scale`, `pause`, `resume` and `status`, which reach a running generation's pool by its name.

Why a pool of our own rather than `ray.data.llm` (`build_processor`): the stage needs live scaling
by command while the job runs, shard leases that survive a killed actor without redoing finished
work, per-prompt rejects with reasons, and token ids written as the engine saw them; Ray Data's
LLM processor scales only inside a fixed range chosen at start, and its checkpointing is reported
to deadlock on clusters of 4 CPUs or fewer, like the 2-core machines this runs on in CI.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from dflash_ray import manifest, storage, writer
from dflash_ray.cluster import connect
from dflash_ray.config import AutoscaleConfig, GenerateConfig, RunConfig, check_lengths
from dflash_ray.errors import DFlashError
from dflash_ray.generation import shards
from dflash_ray.generation.fleet import POOL_TIMEOUT_S, check_room, follow_pool, refuse_same_name
from dflash_ray.generation.leases import PROGRESS
from dflash_ray.generation.options import check_model
from dflash_ray.registry import pin
from dflash_ray.stages import PipelineRun, Stage

log = logging.getLogger(__name__)


def _check_samples(gcfg: GenerateConfig) -> None:
    if gcfg.samples_per_prompt < 1 or (gcfg.samples_per_prompt > 1 and gcfg.temperature <= 0):
        raise DFlashError(
            f"{gcfg.samples_per_prompt} samples per prompt need at least one, and more than one "
            "needs temperature > 0 (greedy samples are all the same)",
            field="generate.samples_per_prompt",
        )


def run_generate(prompts_uri: str, output: str, model: str, cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    import ray

    gcfg = cfg.generate
    _check_samples(gcfg)
    if storage.overlaps(prompts_uri, output):  # a commit replaces the output's shards: never among the prompts'
        raise DFlashError(
            f"the output {output} and the prompts {prompts_uri} overlap (one is, or is inside, the other): writing "
            "there could replace the prompts' files; give an output folder of its own",
            file=output,
        )
    storage.require_folder(output)
    length_warning = check_lengths(cfg)
    if length_warning:
        log.warning(length_warning)
    started = time.time()
    manifest.require_columns(prompts_uri, ["messages"], "--prompts (a prompts dataset)")  # before any engine starts
    units = shards.plan_units(manifest.dataset_files(prompts_uri, (".parquet",)), gcfg.shard_size)
    model = pin(model)  # a Hub id: the commit every generator reads, recorded in the manifest
    plan = shards.shard_plan(prompts_uri, units, model, gcfg)
    done = shards.finished_shards(output, plan)
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
                **shards.totals(done),
                "generators_started": 0,
                "restarts": 0,
                "seconds": round(time.time() - started, 1),
                "tokens_per_s": None,
            },
            output,
        )
    if todo:
        check_model(model)
    with writer.output(output, "completions") as held:  # ours or refused before Ray starts; one run writes here
        connect(cfg.ray)
        check_room(gcfg, [n["Resources"] for n in ray.nodes() if n.get("Alive")])
        if committed:  # the old dataset stops being complete now
            storage.delete(storage.join(output, manifest.MANIFEST))
        refuse_same_name(ray, gcfg)
        final, done, fleet = follow_pool(units, done, todo, model, cfg, output, plan, progress)
        summary.update(
            shards.totals(done),
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
        shards.commit(output, units, done, summary, cfg)
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
    """Set the number of generator actors of a running generation (`dflash-ray scale generators N`):
    0, or a count the autoscaler's bound (generate.autoscale.max_generators' range) takes."""
    import dataclasses

    import ray

    if n < 0:
        raise DFlashError(f"must be >= 0, got {n}", field="generators")
    ok, allowed = {f.name: f for f in dataclasses.fields(AutoscaleConfig)}["max_generators"].metadata["range"]
    if n > 0 and not ok(n):
        raise DFlashError(
            f"{n}: allowed: 0, or {allowed} (generate.autoscale.max_generators' range)", field="generators"
        )
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
        progress = shards.read_progress(output)
        if progress is None:
            raise DFlashError("no generation progress here", file=storage.join(output, PROGRESS))
        done = {int(k): v for k, v in progress["done"].items()}
        info = _manifest_of(output)
        return {
            "stage": "status",
            "output": output,
            "complete": info is not None,
            "shards_done": len(done),
            **shards.totals(done),
        }
    return {"stage": "status", "name": cfg.generate.name, **ray.get(_pool(cfg).status.remote(), timeout=POOL_TIMEOUT_S)}


def _manifest_of(output: str) -> dict[str, Any] | None:
    """The manifest that makes a finished generation's output a dataset (None: not committed yet);
    one that is not UTF-8 text, or not a mapping, refused naming it."""
    uri = storage.join(output, manifest.MANIFEST)
    try:
        info = manifest.read_manifest(output)
    except UnicodeDecodeError as e:
        raise DFlashError(f"corrupt manifest: not UTF-8 text ({e.reason} at byte {e.start})", file=uri) from None
    if info is not None and not isinstance(info, dict):
        raise DFlashError("not a dataset manifest (a mapping with `files`)", file=uri, field="files")
    return info


def _named(cfg: RunConfig, name: str | None) -> RunConfig:
    import dataclasses

    if name is not None and not name.strip():
        raise DFlashError("is empty: give the generation's name (generate.name), or leave --name out", field="--name")
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
