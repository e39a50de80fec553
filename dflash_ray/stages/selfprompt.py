"""`dflash-ray selfprompt`: prompts the target writes itself, as a chat JSONL the prompts stage reads.

The `selfprompt.count` candidates are split over `generate.generators` Ray tasks, each holding one
engine with generate's resources and backend; every candidate's seed comes from its index, so the
result does not depend on how many tasks ran. The driver reads every task's stream as it comes; a
task that fails (an engine that cannot start) stops the run at once with that task's own error,
the others cancelled. The driver drops cut, short and repeated messages
(counted by reason) and writes `self-prompts.jsonl`, then the manifest. A rerun with the same
settings finds the manifest and does nothing; other settings into the same output are refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any, cast

from dflash_ray import manifest, storage, writer
from dflash_ray.cluster import connect
from dflash_ray.config import GenerateConfig, RunConfig, SelfPromptConfig
from dflash_ray.errors import DFlashError, failure_cause
from dflash_ray.stages import PipelineRun, Stage

if TYPE_CHECKING:
    from ray import ObjectRefGenerator

FILE = "self-prompts.jsonl"


def _write(model: str, gcfg: GenerateConfig, scfg: SelfPromptConfig, indices: list[int]):
    """A streaming task: one engine, each batch's candidates returned as soon as they exist."""
    from dflash_ray.generation.engines import make_engine
    from dflash_ray.generation.selfprompt import write_prompts
    from dflash_ray.registry import load_tokenizer, resolve, stop_token_ids

    model_dir = resolve(model)
    tokenizer = load_tokenizer(model_dir)
    engine = make_engine(model_dir, gcfg, stop_token_ids(tokenizer))
    yield from write_prompts(engine, tokenizer, scfg, indices, gcfg.batch_size)


def run_selfprompt(model: str, output: str, cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    import ray
    from tqdm import tqdm

    from dflash_ray.generation.selfprompt import select
    from dflash_ray.generation.options import check_model, engine_options

    scfg = cfg.selfprompt
    if scfg.count < 1:
        raise DFlashError(f"{scfg.count} prompts to write; at least 1", field="selfprompt.count")
    storage.require_folder(output)
    started = time.time()
    settings = {"model": model, "backend": cfg.generate.backend, **dataclasses.asdict(scfg)}
    made = manifest.read_manifest(output)
    if made is not None:
        if made.get("config") != settings:
            raise DFlashError(
                "holds prompts written with other settings; choose another --output or delete it",
                file=storage.join(output, manifest.MANIFEST),
            )
        return {**made["summary"], "reused": True, "seconds": round(time.time() - started, 1)}
    check_model(model)
    gcfg = dataclasses.replace(
        cfg.generate, temperature=scfg.temperature, top_p=scfg.top_p, max_tokens=scfg.max_tokens, seed=scfg.seed
    )
    with writer.output(output, "prompts-jsonl"):  # ours or refused, before Ray starts
        connect(cfg.ray)
        tasks = max(1, min(gcfg.generators, scfg.count))
        write = ray.remote(_write).options(**engine_options(gcfg), num_returns="streaming")
        streams = [write.remote(model, gcfg, scfg, list(range(t, scfg.count, tasks))) for t in range(tasks)]
        candidates: list[dict[str, Any]] = []
        with tqdm(total=scfg.count, desc="selfprompt", unit="prompt", disable=not progress) as bar:
            live = list(streams)
            while live:
                ready, _ = ray.wait(live, num_returns=1)
                try:
                    part = ray.get(next(cast("ObjectRefGenerator", ready[0])))  # num_returns="streaming"
                except StopIteration:
                    live.remove(ready[0])
                    continue
                except Exception as e:
                    for stream in live:
                        ray.cancel(stream, force=True)
                    raise DFlashError(f"a self-prompt task failed: {failure_cause(e)} (stopped at once)") from None
                candidates += part
                bar.update(len(part))
        records, dropped = select(candidates, scfg)
        storage.write_text(
            storage.join(output, FILE), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        )
        summary = {
            "stage": "selfprompt",
            "output": output,
            "file": storage.join(output, FILE),
            "model": model,
            "candidates": len(candidates),
            "prompts": len(records),
            "dropped": dropped,
        }
        manifest.write_manifest(
            output, kind="prompts-jsonl", files=[{"name": FILE, "rows": len(records)}], summary=summary, config=settings
        )
        return {**summary, "reused": False, "seconds": round(time.time() - started, 1)}


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    if args.count is not None:
        cfg = dataclasses.replace(cfg, selfprompt=dataclasses.replace(cfg.selfprompt, count=args.count))
    return run_selfprompt(args.model, args.output, cfg, progress=not args.json)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--count", type=int, metavar="N", help="candidates to sample (selfprompt.count)")
    p.add_argument("--output", required=True, metavar="URI", help="folder; `dflash-ray prompts --input` reads it")


def _step(run: PipelineRun) -> dict[str, Any]:
    """With `selfprompt.count` > 0, prompts the target writes itself join the given ones."""
    if run.cfg.selfprompt.count < 1:
        return {"self_prompts": 0, "self_prompts_dropped": {}}
    cfg = run.cfg
    written = run.timed(
        "selfprompt", run_selfprompt, cfg.pipeline.target, run.at("self-prompts"), cfg, progress=run.progress
    )
    return {"self_prompts": written["prompts"], "self_prompts_dropped": written["dropped"]}


STAGES = (
    Stage(
        name="selfprompt",
        help="prompts the target writes itself (chat JSONL)",
        command=_command,
        arguments=_arguments,
        section="selfprompt",
        order=5,
        outputs=("self-prompts",),
        step=_step,
    ),
)
