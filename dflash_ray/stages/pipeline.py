"""`dflash-ray pipeline`: every stage in order on one config, each output under `pipeline.workdir`.

prompts (plus those the target writes itself when `selfprompt.count` > 0) → a few prompts kept
aside for evaluation → generation by the target itself → Ray Data tokenization → validation gate
(stops here when it fails) → online training → evaluation of the untrained and the trained
drafter on the kept-aside prompts (real speculative decoding) → export. With `pipeline.responses`
the inputs' own last answers are the completions (no generation) and their contexts the prompts.
Each stage resumes as it does alone: finished generation shards are skipped and training continues
from its newest complete checkpoint. `pipeline.min_tau_gain` makes the run fail unless training
raised the acceptance length by that much.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from dflash_ray import manifest, storage
from dflash_ray.config import RunConfig
from dflash_ray.preflight import preflight
from dflash_ray.errors import DFlashError, GateFailed


def split_prompts(
    prompts: str, train_out: str, eval_out: str, eval_count: int, seed: int, answered: bool = False
) -> int:
    """Keep `eval_count` prompts (a seeded choice by id) out of generation and training. `answered`:
    the rows are completions (existing responses); the kept-aside part keeps their prompt fields."""
    from dflash_ray.data import schema
    from dflash_ray.stages.prompts import shard_bytes

    train_schema = schema.COMPLETIONS if answered else schema.PROMPTS
    rows = manifest.read_rows(prompts, list(train_schema.names), 10**9)
    if eval_count >= len(rows):
        raise DFlashError(
            f"{eval_count} prompts kept aside for evaluation out of {len(rows)}: none would be left "
            "to train on; allowed: fewer than the prompts",
            field="pipeline.eval_prompts",
        )
    order = sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:{r['id']}".encode()).hexdigest())
    held = {r["id"] for r in order[:eval_count]}
    for out, part, table_schema in (
        (eval_out, [r for r in rows if r["id"] in held], schema.PROMPTS),
        (train_out, [r for r in rows if r["id"] not in held], train_schema),
    ):
        kind = "completions" if table_schema is schema.COMPLETIONS else "prompts"
        rows_part = [{k: r.get(k) for k in table_schema.names} for r in part]
        storage.write_bytes(storage.join(out, f"{kind}-00000.parquet"), shard_bytes(rows_part, table_schema))
        manifest.write_manifest(
            out, kind=kind, files=[{"name": f"{kind}-00000.parquet", "rows": len(part)}], summary={kind: len(part)}
        )
    return len(rows) - len(held)


TRAINING_FILES = {"metrics.jsonl", "metrics.png", "evaluation.png"}  # what a training run writes beside
TRAINING_DIRS = {"checkpoints", "profile"}  # its checkpoints and traces


def clear_training(folder: str, cfg: RunConfig) -> None:
    """Delete an earlier training run's output at `folder` (to train afresh), only when all it holds
    is what training writes; anything else is named and nothing is deleted."""
    from dflash_ray.train import drafters

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


def unseen_prompts(inputs: list, trained: str, output: str, cfg: RunConfig) -> int:
    """The `pipeline.unseen_prompts` files as a prompts dataset at `output`; one that is also among the
    run's own prompts (`trained`: the same conversation, by its content id) is refused, naming it."""
    from dflash_ray.stages.prompts import run_prompts

    summary = run_prompts(list(inputs), output, cfg, progress=False)
    own = {r["id"] for r in manifest.read_rows(trained, ["id"], 10**9)}
    shared = [r["id"] for r in manifest.read_rows(output, ["id"], 10**9) if r["id"] in own]
    if shared:
        raise DFlashError(
            f"{len(shared)} of its prompts are among the run's own inputs (first id {shared[0]}): "
            "they would not be unseen",
            field="pipeline.unseen_prompts",
        )
    return int(summary["prompts"])


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
    """prompts → (eval prompts kept aside) → generate → tokenize → validate → train → evaluate the
    untrained and trained drafter → export, every output under `pipeline.workdir`. `fresh_training`:
    an earlier training output in the workdir is deleted first (after every setting is checked)."""
    from dflash_ray.chaos import Injector
    from dflash_ray.stages.prompts import run_prompts
    from dflash_ray.stages.validate import run_validate
    from dflash_ray.stages.generate import run_generate
    from dflash_ray.stages.tokenize import run_tokenize

    pcfg = cfg.pipeline
    for key in ("inputs", "workdir", "target"):
        if not getattr(pcfg, key) and not (key == "inputs" and (cfg.selfprompt.count > 0 or cfg.prompts.sources)):
            raise DFlashError("must be set for the pipeline", field=f"pipeline.{key}")
    cfg = with_target_tokenizer(cfg)
    # refused settings fail before the prompts stage, not at generation or in training
    preflight(cfg, generating=not pcfg.responses)
    if fresh_training:
        clear_training(storage.join(pcfg.workdir, "train"), cfg)
    work = pcfg.workdir
    started = time.time()
    timings: dict[str, float] = {}

    def at(name: str) -> str:
        return storage.join(work, name)

    def timed(name: str, fn, *args, **kwargs):
        t = time.time()
        out = fn(*args, **kwargs)
        timings[name] = round(time.time() - t, 1)
        return out

    with Injector(cfg.chaos) as chaos:  # `chaos.faults`: a drill, killing actors while the stages run
        inputs = list(pcfg.inputs)
        written = None
        if cfg.selfprompt.count > 0:  # prompts the target writes itself join the given ones
            from dflash_ray.stages.selfprompt import run_selfprompt

            written = timed("selfprompt", run_selfprompt, pcfg.target, at("self-prompts"), cfg, progress=progress)
            inputs.append(at("self-prompts"))
        prompts = timed("prompts", run_prompts, inputs, at("prompts"), cfg, progress=progress, responses=pcfg.responses)
        if pcfg.unseen_prompts:
            timed("prompts_unseen", unseen_prompts, pcfg.unseen_prompts, at("prompts"), at("prompts-unseen"), cfg)
        if pcfg.responses:  # the answers are the completions; their contexts are the kept-aside prompts
            kept = split_prompts(
                at("prompts"), at("completions"), at("prompts-eval"), pcfg.eval_prompts, cfg.seed, answered=True
            )
            generated = {
                "completions": kept,
                "rejected_kinds": {},
                "generator_nodes": [],
                "output_tokens": 0,
                "tokens_per_s": None,
            }
        else:
            split_prompts(at("prompts"), at("prompts-train"), at("prompts-eval"), pcfg.eval_prompts, cfg.seed)
            generated = timed(
                "generate", run_generate, at("prompts-train"), at("completions"), pcfg.target, cfg, progress=progress
            )
        tokenized = timed("tokenize", run_tokenize, at("completions"), at("tokenized"), cfg)
        report = timed("validate", run_validate, at("tokenized"), cfg, report_dir=at("report"))
        summary = {
            "stage": "pipeline",
            "workdir": work,
            "target": pcfg.target,
            "responses": pcfg.responses,
            "records": prompts["records"],
            "prompts": prompts["prompts"],
            "quarantined": prompts["quarantined"],
            "quarantine_kinds": prompts["quarantine_kinds"],
            "self_prompts": written["prompts"] if written else 0,
            "self_prompts_dropped": written["dropped"] if written else {},
            "eval_prompts": pcfg.eval_prompts,
            "completions": generated["completions"],
            "generation_rejected": generated["rejected_kinds"],
            "generator_nodes": generated["generator_nodes"],
            "generated_tokens": generated["output_tokens"],
            "generate_tokens_per_s": generated["tokens_per_s"],
            "samples": tokenized["rows_out"],
            "tokens": tokenized["tokens"],
            "tokens_cut": tokenized["tokens_cut"],
            "share_kept": tokenized["share_kept"],
            "length_warning": generated.get("length_warning"),
            "loss_tokens": report["stats"]["loss_tokens"],
            "response_fraction": round(report["stats"]["response_fraction"], 4),
            "loss_mask_sum_median": report["stats"]["loss_mask_sum"]["median"],
            "gate_passed": report["passed"],
            "failed_rules": report["failed_rules"],
            "report": at("report/report.md"),
        }
        if not report["passed"]:
            raise GateFailed(f"validation gate failed: {report['failed_rules']}", file=at("tokenized")).with_summary(
                summary
            )
        summary.update(_train_and_evaluate(work, cfg, progress, timed))
    if cfg.chaos.faults:  # the run got here: every fault fired was recovered from
        drill = chaos.summary()
        summary["chaos"] = {
            **drill,
            "recovered": drill["injected"],
            "restarts": {"generate": generated.get("restarts", 0), "train": summary["train_restarts"]},
            "seconds_lost": {"generate": generated.get("seconds_lost", 0.0), "train": summary["train_seconds_lost"]},
        }
    summary["stage_seconds"] = timings
    summary["seconds"] = round(time.time() - started, 1)
    teams = summary.get("drafters") or {"": summary}
    for result in teams.values():
        result["tau_gain"] = round((result["tau_trained"] or 0) - (result["tau_untrained"] or 0), 4)
    summary["tau_gain"] = next(iter(teams.values()))["tau_gain"]  # the first drafter's, as its other figures
    summary["tau_gain_required"] = pcfg.min_tau_gain
    for name, result in teams.items():
        try:
            _gate(result, name, pcfg)
        except DFlashError as e:
            raise e.with_summary(summary) from None
    return summary


def _gate(result: dict[str, Any], name: str, pcfg) -> None:
    """The learning gates on one drafter's figures: its gain over its start and, when asked, its
    acceptance beside n-gram prompt lookup's on the same prompts."""
    gain = result["tau_gain"]
    who = f"drafter {name!r}: " if name else ""
    if gain < pcfg.min_tau_gain:
        raise DFlashError(
            f"{who}the trained drafter's tau {result['tau_trained']} beats the untrained one's "
            f"{result['tau_untrained']} by {gain:.3f}, less than {pcfg.min_tau_gain}",
            field="pipeline.min_tau_gain",
        )
    if pcfg.beat_ngram and (result["tau_trained"] or 0) <= (result["tau_ngram"] or 0):
        raise DFlashError(
            f"{who}the trained drafter's tau {result['tau_trained']} does not beat n-gram prompt "
            f"lookup's {result['tau_ngram']} on the same prompts",
            field="pipeline.beat_ngram",
        )


def _train_and_evaluate(work: str, cfg: RunConfig, progress: bool, timed) -> dict[str, Any]:
    """Train (every drafter of `train.drafters` from one target pass), then export and evaluate each.
    The first drafter's figures are the summary's own; with several, each one's under `drafters`."""
    from dflash_ray.stages.train import run_train
    from dflash_ray.train import drafters

    train = timed(
        "train",
        run_train,
        cfg.pipeline.target,
        storage.join(work, "tokenized"),
        storage.join(work, "train"),
        cfg,
        progress=progress,
    )
    references: dict = {}  # the target's own outputs, decoded once for every drafter
    folders = drafters.outputs(storage.join(work, "train"), cfg)  # each drafter's training folder
    results = {
        name: _export_and_evaluate(
            work, name, team_cfg, train["drafters"][name] if name else train, folder, references, timed
        )
        for (name, team_cfg), folder in zip(drafters.expand(cfg), folders)
    }
    shared = {
        "training_steps": train["step"],
        "stream_nodes": train["stream_nodes"],
        "coordinator_node": train["coordinator_node"],
        "train_restarts": train["restarts"],
        "train_seconds_lost": train["seconds_lost"],
    }
    first = next(iter(results.values()))
    return {**shared, **first, **({"drafters": results} if cfg.train.drafters else {})}


def _export_and_evaluate(
    work: str, name: str, cfg: RunConfig, trained: dict[str, Any], folder: str, references: dict, timed
) -> dict[str, Any]:
    """One trained drafter (`name` "" for a run of one): exported under `drafter/`, evaluated beside
    the drafter its training started from, on the kept-aside prompts."""
    import importlib.util
    import tempfile

    import torch

    from dflash_ray.drafter import families
    from dflash_ray.drafter.export import from_hf_config, save_drafter
    from dflash_ray.drafter.init import initial_drafter
    from dflash_ray.drafter.shape import drafter_config, drafter_init
    from dflash_ray.registry import resolve
    from dflash_ray.stages.evaluate import run_evaluate
    from dflash_ray.stages.export import run_export

    target = cfg.pipeline.target
    drafter = storage.join(work, "drafter", name) if name else storage.join(work, "drafter")
    run_export(trained["checkpoint"], drafter, dtype="float32")
    untrained = tempfile.mkdtemp(prefix="dflash-untrained-")  # the drafter training started from
    start = initial_drafter(
        from_hf_config(drafter_config(target, cfg)), resolve(target), drafter_init(target, cfg), cfg.train.seed
    )
    save_drafter(start, untrained, dtype=torch.float32)
    eval_prompts = storage.join(work, "prompts-eval")
    tag = f"[{name}]" if name else ""
    # the start is measured greedy only: its sampled tau says nothing the greedy one does not
    before = timed(
        f"evaluate_untrained{tag}",
        run_evaluate,
        untrained,
        target,
        eval_prompts,
        cfg,
        sampled=False,
        reference_cache=references,
    )
    # vLLM's own acceptance of the exported drafter, on the same prompts, where vLLM serves its family
    served = families.get(cfg.train.drafter).vllm_on_cpu or torch.cuda.is_available()
    engine = "vllm" if cfg.pipeline.vllm_evaluate and served and importlib.util.find_spec("vllm") else "hf"
    after = timed(
        f"evaluate_trained{tag}",
        run_evaluate,
        drafter,
        target,
        eval_prompts,
        cfg,
        engine=engine,
        reference_cache=references,
        report_dir=folder,
    )
    unseen = {}
    if cfg.pipeline.unseen_prompts:  # prompts of other kinds: never generated for, trained on or tuned on
        result = timed(
            f"evaluate_unseen{tag}",
            run_evaluate,
            drafter,
            target,
            storage.join(work, "prompts-unseen"),
            cfg,
            sampled=False,
            reference_cache=references,
        )
        unseen = {
            "unseen": {
                "prompts": result["prompts"],
                "tau_trained": result["tau"],
                "tau_ngram": result["tau_ngram"],
                "tau_per_source": result["tau_per_source"],
                "tau_ngram_per_source": result["tau_ngram_per_source"],
                "acceptance_by_position": result["acceptance_by_position"],
                "lossless": result["lossless"],
            }
        }
    return {
        **unseen,
        "family": cfg.train.drafter,
        "train_loss": trained["loss"],
        "heldout_tau_start": trained["heldout_tau_start"],
        "heldout_tau_end": trained["heldout_tau"],
        "tau_untrained": before["tau"],
        "tau_trained": after["tau"],
        "tau_ngram": after["tau_ngram"],
        "tau_trained_sampled": after["tau_sampled"],
        "acceptance_by_position": after["acceptance_by_position"],
        "acceptance_by_position_sampled": after["acceptance_by_position_sampled"],
        "ngram_acceptance_by_position": after["ngram_acceptance_by_position"],
        "tau_per_source": after["tau_per_source"],
        "tau_ngram_per_source": after["tau_ngram_per_source"],
        "evaluation_png": after["evaluation_png"],
        "sampling": after["sampling"],
        "tau_ngram_per_draft": after["tau_ngram_per_draft"],
        "ngram_draft_share": after["ngram_draft_share"],
        "tau_trained_vllm": after.get("tau_vllm"),
        "vllm_outputs_equal": after.get("vllm_outputs_equal"),
        "tau_trained_sampled_vllm": after.get("tau_vllm_sampled"),
        "spec_tokens_per_s": after["tokens_per_s"],
        "target_tokens_per_s": after["target_tokens_per_s"],
        "lossless": before["lossless"] and after["lossless"],
        "plots": storage.join(folder, "metrics.png"),
        "drafter": drafter,
    }
