"""`dflash-ray pipeline`: every stage in order on one config, each output under `pipeline.workdir`.

prompts (plus those the target writes itself when `selfprompt.count` > 0) → a few prompts kept
aside for evaluation → generation by the target itself → Ray Data tokenization → validation gate
(stops here when it fails) → online training → export → evaluation of the trained drafter on the
kept-aside prompts (real speculative decoding), prompt lookup beside it. With `pipeline.responses`
the inputs' own last answers are the completions (no generation) and their contexts the prompts.
Each stage resumes as it does alone: finished generation shards are skipped and training continues
from its newest complete checkpoint. `pipeline.min_tau_gain` makes the run fail unless training
raised the held-out simulated acceptance length by that much over its step 0.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from dflash_ray import storage, writer
from dflash_ray.config import RunConfig
from dflash_ray.preflight import preflight
from dflash_ray.errors import DFlashError
from dflash_ray.stages import Stage


# what a training run writes beside its checkpoints (its compiled artifacts among them)
TRAINING_FILES = {
    "metrics.jsonl",
    "metrics.png",
    "evaluation.png",
    "evaluation-unseen.png",
    "compile-cache.bin",
    writer.WRITER,
    writer.MARK,  # the training output's claim: `writer.output` marks the folder it trains into
}
TRAINING_DIRS = {"checkpoints", "profile", "metrics"}  # its checkpoints, traces and metric history
MADE_HERE = "_pipeline.json"  # in the workdir: the training outputs its pipeline made, which it may clear


def clear_pipeline_training(workdir: str, cfg: RunConfig) -> None:
    """Clear the workdir's `train/` to train afresh, only when this workdir's pipeline made it (a
    `train/` of another run's checkpoints is named and kept); then mark it as the pipeline's."""
    import json

    folder, mark = storage.join(workdir, "train"), storage.join(workdir, MADE_HERE)
    try:
        made = list(json.loads(storage.read_text(mark))["made"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):  # none, or not ours to trust: nothing made
        made = []
    held = storage.list_files(folder) + storage.skipped_files(folder) + storage.list_dirs(folder)
    if held and "train" not in made:
        raise DFlashError(
            "holds a training output this workdir's pipeline did not make (another run's checkpoints?): "
            "nothing was deleted; move it, or choose another workdir",
            file=folder,
        )
    if held:
        clear_training(folder, cfg)
    storage.write_text(mark, json.dumps({"made": sorted({*made, "train"})}))


def clear_training(folder: str, cfg: RunConfig) -> None:
    """Delete an earlier training run's output at `folder` (to train afresh), only when all it holds
    is what training writes; anything else is named and nothing is deleted."""
    from dflash_ray.train import drafters

    writer.refuse_if_held(folder, "training into")  # a live run's output is never cleared under it
    names = {name for name, _ in drafters.expand(cfg) if name}
    files = storage.list_files(folder) + storage.skipped_files(folder)
    unknown = [storage.basename(f) for f in files if storage.basename(f) not in TRAINING_FILES]
    unknown += [
        storage.basename(d) + "/" for d in storage.list_dirs(folder) if storage.basename(d) not in TRAINING_DIRS | names
    ]
    if unknown:
        raise DFlashError(
            f"holds {', '.join(sorted(unknown)[:10])}, which no training run wrote: nothing was deleted; "
            "move them, or choose another workdir",
            file=folder,
        )
    storage.delete_tree(folder)


def earlier_pipeline(workdir: str) -> bool:
    """A workdir an earlier pipeline wrote before workdirs were marked: one of its stage folders holds
    a dataset's manifest or an output's mark, or its training was marked as the pipeline's."""
    from dflash_ray import manifest
    from dflash_ray.stages import stages

    if storage.exists(storage.join(workdir, MADE_HERE)):
        return True
    folders = {storage.join(workdir, f) for stage in stages() for f in stage.outputs}
    return any(
        storage.exists(storage.join(folder, name)) for folder in folders for name in (manifest.MANIFEST, writer.MARK)
    )


def with_target_tokenizer(cfg: RunConfig) -> RunConfig:
    """The pipeline trains the target's drafter on the target's own token ids: the prompts and
    tokenize stages use the target's tokenizer unless a config names one."""
    import dataclasses

    from dflash_ray.config import PromptsConfig, TokenizeConfig

    target = cfg.pipeline.target
    if cfg.tokenize.tokenizer == TokenizeConfig().tokenizer:
        cfg = dataclasses.replace(cfg, tokenize=dataclasses.replace(cfg.tokenize, tokenizer=target))
    if cfg.prompts.tokenizer == PromptsConfig().tokenizer:
        cfg = dataclasses.replace(cfg, prompts=dataclasses.replace(cfg.prompts, tokenizer=target))
    return cfg


def run_pipeline(cfg: RunConfig, *, progress: bool = True, fresh_training: bool = False) -> dict[str, Any]:
    """Every stage with a pipeline step, in the order what each reads and writes gives (selfprompt →
    prompts → generate → tokenize → validate → train → export → evaluate), every output under
    `pipeline.workdir`. `fresh_training`: an earlier training output in the workdir is deleted first
    (after every setting is checked)."""
    from dflash_ray.chaos import Injector
    from dflash_ray.stages import PipelineRun, pipeline_stages

    pcfg = cfg.pipeline
    for key in ("inputs", "workdir", "target"):
        if not getattr(pcfg, key) and not (key == "inputs" and (cfg.selfprompt.count > 0 or cfg.prompts.sources)):
            raise DFlashError("must be set for the pipeline", field=f"pipeline.{key}")
    if pcfg.min_tau_gain > 0 and not (cfg.train.heldout > 0 and cfg.train.eval_every > 0):
        raise DFlashError(
            "training's gain is measured on its held-out samples (the simulated tau at step 0 against the "
            "end's): set train.heldout and train.eval_every above 0, or pipeline.min_tau_gain to 0",
            field="pipeline.min_tau_gain",
        )
    storage.require_folder(pcfg.workdir)
    cfg = with_target_tokenizer(cfg)
    # refused settings fail before the prompts stage, not at generation or in training
    preflight(cfg, generating=not pcfg.responses)
    started = time.time()
    run = PipelineRun(cfg, progress)
    run.summary.update(stage="pipeline", workdir=pcfg.workdir, target=pcfg.target, responses=pcfg.responses)
    # a workdir of ours (new, marked, or an earlier pipeline's) or refused naming what it holds; one run at a time
    with writer.output(pcfg.workdir, "pipeline", ours_if=lambda: earlier_pipeline(pcfg.workdir)):
        if fresh_training:
            clear_pipeline_training(pcfg.workdir, cfg)
        with Injector(cfg.chaos) as chaos:  # `chaos.faults`: a drill, killing actors while the stages run
            for stage in pipeline_stages():
                assert stage.step is not None  # what `pipeline_stages` holds
                part = stage.step(run)
                if part is not None:
                    run.summary.update(part)
    summary = run.summary
    if cfg.chaos.faults:  # the run got here: every fault fired was recovered from
        drill = chaos.summary()
        generated = run.results.get("generate", {})
        summary["chaos"] = {
            **drill,
            "recovered": drill["injected"],
            "restarts": {"generate": generated.get("restarts", 0), "train": summary["train_restarts"]},
            "seconds_lost": {"generate": generated.get("seconds_lost", 0.0), "train": summary["train_seconds_lost"]},
        }
    summary["stage_seconds"] = run.timings
    summary["seconds"] = round(time.time() - started, 1)
    summary["tau_gain_required"] = pcfg.min_tau_gain
    for name, result in (summary.get("drafters") or {"": summary}).items():
        try:
            _gate(result, name, pcfg)
        except DFlashError as e:
            raise e.with_summary(summary) from None
    return summary


def _gate(result: dict[str, Any], name: str, pcfg) -> None:
    """The learning gates on one drafter's figures: its held-out gain over its start and, when
    asked, its acceptance beside n-gram prompt lookup's on the same prompts."""
    gain = result["tau_gain"]
    who = f"drafter {name!r}: " if name else ""
    if pcfg.min_tau_gain > 0 and (gain is None or gain < pcfg.min_tau_gain):
        raise DFlashError(
            f"{who}training raised the held-out simulated tau from {result['heldout_tau_start']} to "
            f"{result['heldout_tau_end']}, a gain of {gain}, less than {pcfg.min_tau_gain}",
            field="pipeline.min_tau_gain",
        )
    # on the kept-aside prompts, and on the prompts of kinds training never saw where there are some
    for where, figures, setting in (
        ("kept-aside", result, "beat_ngram"),
        ("unseen", result.get("unseen"), "beat_ngram_unseen"),
    ):
        if getattr(pcfg, setting) and figures and (figures["tau_trained"] or 0) <= (figures["tau_ngram"] or 0):
            raise DFlashError(
                f"{who}the trained drafter's tau {figures['tau_trained']} does not beat n-gram prompt "
                f"lookup's {figures['tau_ngram']} on the same {where} prompts",
                field=f"pipeline.{setting}",
            )


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    import dataclasses

    changes = {k: v for k, v in (("workdir", args.workdir), ("target", args.target)) if v}
    if args.input:
        changes["inputs"] = args.input
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, **changes))
    return run_pipeline(cfg, progress=not args.json)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", action="extend", metavar="URI", help="raw datasets (pipeline.inputs)")
    p.add_argument("--workdir", metavar="URI", help="where every stage writes (pipeline.workdir)")
    p.add_argument("--target", metavar="PATH", help="target model (pipeline.target)")


STAGES = (
    Stage(
        name="pipeline",
        help="every stage in order on one config (pipeline.*)",
        command=_command,
        arguments=_arguments,
        section="pipeline",
        order=90,
    ),
)
