"""`dflash-ray evaluate`: acceptance length of a drafter against its target, measured for real.

For each prompt the target decodes greedily alone and with the drafter (speculative decoding);
the two outputs must be equal token for token, and the run says so. Reported: tau (tokens
committed per verify step) overall and per prompt source, tokens/s of both; tau at the serving
temperature and top-p (`evaluate.temperature`, `evaluate.top_p`) under the speculative-sampling
rule; the n-gram prompt-lookup baseline on the same outputs as tokens per target forward (`tau_ngram`,
comparable with tau) and per proposed draft (`tau_ngram_per_draft`, vLLM's definition) with the
share of steps that had a draft; and the simulated tau on a tokenized held-out set (the figure
training reports). `--engine vllm` adds vLLM's own measured acceptance length.

This module holds the command and its pipeline step (each trained drafter, on the kept-aside and
the unseen prompts); the measurement is `drafter/acceptance.py`, the models it decodes with
`drafter/evaluation_models.py`.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from dflash_ray import manifest, storage, writer
from dflash_ray.config import RunConfig
from dflash_ray.drafter import acceptance
from dflash_ray.drafter.evaluation_models import load_models
from dflash_ray.errors import DFlashError
from dflash_ray.stages import PipelineRun, Stage


def _check_inputs(prompts_uri: str, heldout_uri: str | None, report_dir: str | None) -> None:
    """Wrong inputs fail here, before minutes of loading models."""
    manifest.require_columns(prompts_uri, ["messages"], "--prompts (a prompts dataset)")
    for flag, uri in (("--prompts", prompts_uri), ("--heldout", heldout_uri)):
        if report_dir is not None and uri and storage.overlaps(uri, report_dir):
            raise DFlashError(
                f"the report folder and the {flag} dataset {uri} overlap (one is, or is inside, the other): the "
                "report would be written among the dataset's files; give a report folder of its own",
                file=report_dir,
                field="--report",
            )
    if heldout_uri:
        manifest.require_columns(heldout_uri, ["input_ids", "loss_mask"], "--heldout (a tokenized dataset)")


def _write_report(summary: dict[str, Any], report_dir: str) -> None:
    from dflash_ray.plots import acceptance_png

    summary["evaluation_png"] = storage.join(report_dir, "evaluation.png")
    storage.write_bytes(summary["evaluation_png"], acceptance_png(summary))


def run_evaluate(
    drafter_uri: str,
    target_uri: str,
    prompts_uri: str,
    cfg: RunConfig,
    *,
    heldout_uri: str | None = None,
    engine: str = "hf",
    tokenizer_name: str | None = None,
    sampled: bool = True,
    reference_cache: dict | None = None,
    report_dir: str | None = None,
) -> dict[str, Any]:
    """`sampled=False` skips the serving-temperature run; `reference_cache` (a dict the caller keeps)
    holds the target's own greedy outputs across calls on the same target and prompts, so a second
    drafter's evaluation does not decode them again. `report_dir`: where `evaluation.png` goes
    (acceptance by draft position and by prompt source, the drafter beside prompt lookup), a folder
    of its own, held while the run lasts."""
    _check_inputs(prompts_uri, heldout_uri, report_dir)  # before any model loads
    measure = functools.partial(
        _evaluate,
        drafter_uri,
        target_uri,
        prompts_uri,
        cfg,
        heldout_uri=heldout_uri,
        engine=engine,
        tokenizer_name=tokenizer_name,
        sampled=sampled,
        reference_cache=reference_cache,
    )
    if report_dir is None:
        return measure(report_dir=None)
    with writer.output(report_dir, "evaluation-report"):
        return measure(report_dir=report_dir)


def _evaluate(
    drafter_uri: str,
    target_uri: str,
    prompts_uri: str,
    cfg: RunConfig,
    *,
    heldout_uri: str | None,
    engine: str,
    tokenizer_name: str | None,
    sampled: bool,
    reference_cache: dict | None,
    report_dir: str | None,
) -> dict[str, Any]:
    """`run_evaluate` past its checks; `report_dir` is written into as it is (its caller holds it)."""
    ecfg = cfg.evaluate
    models = load_models(drafter_uri, target_uri, tokenizer_name, ecfg)
    rows = acceptance.prompt_rows(prompts_uri, ecfg.num_prompts)
    context = getattr(models.text_cfg, "max_position_embeddings", None)
    encoded, skipped = acceptance.within_context(rows, models.tokenizer, ecfg, context, prompts_uri)
    cache = reference_cache if reference_cache is not None else {}
    tally = acceptance.decode_prompts(models, encoded, ecfg, target_uri, sampled, cache)
    summary = acceptance.summarize(
        tally, drafter_uri, target_uri, models.device, len(encoded), len(skipped), context, ecfg
    )
    if heldout_uri:
        summary["tau_simulated_heldout"] = acceptance.heldout_tau(models, heldout_uri, cfg)
    if engine == "vllm":
        acceptance.add_vllm(summary, models, tally, ecfg)
    if report_dir is not None:
        _write_report(summary, report_dir)
    if tally.mismatches:
        raise DFlashError(
            f"speculative output differs from the target's greedy output on {tally.mismatches} "
            "prompt(s): the drafter path is broken",
            file=drafter_uri,
        ).with_summary(summary)
    return summary


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    return run_evaluate(
        args.drafter,
        args.target,
        args.prompts,
        cfg,
        heldout_uri=args.heldout,
        engine=args.engine,
        tokenizer_name=args.tokenizer,
        report_dir=args.report,
    )


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drafter", required=True, metavar="PATH", help="an exported drafter: a folder, an s3:// URI or a Hub id"
    )
    p.add_argument("--target", required=True, metavar="PATH", help="target model (path, URI or short name)")
    p.add_argument("--prompts", required=True, metavar="URI", help="prompt shards (from `dflash-ray prompts`)")
    p.add_argument("--heldout", metavar="URI", help="tokenized held-out set for the simulated tau")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="vllm: also report vLLM's measured tau")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="default: the target's own")
    p.add_argument(
        "--report",
        metavar="DIR",
        help="write evaluation.png there: acceptance by draft position "
        "and by prompt source, the drafter beside prompt lookup",
    )


def _step(run: PipelineRun) -> dict[str, Any]:
    """Each exported drafter by real speculative decoding on the kept-aside prompts (and on the
    unseen ones), prompt lookup beside it; where it started is training's held-out tau at step 0.
    The first drafter's figures are the summary's own; with several, each one's under `drafters`."""
    from dflash_ray.train import drafters

    references: dict = {}  # the target's own outputs, decoded once for every drafter
    cfg = run.cfg
    folders = drafters.outputs(run.at("train"), cfg)  # each drafter's training folder
    results = {
        name: _evaluate_drafter(run, name, team_cfg, folder, references)
        for (name, team_cfg), folder in zip(drafters.expand(cfg), folders)
    }
    return {**next(iter(results.values())), **({"drafters": results} if cfg.train.drafters else {})}


def first_position(rates: list[float | None]) -> float | None:
    """The first draft's acceptance (None: nothing was drafted)."""
    return rates[0] if rates else None


def _evaluate_drafter(run: PipelineRun, name: str, cfg: RunConfig, folder: str, references: dict) -> dict[str, Any]:
    import importlib.util

    import torch

    from dflash_ray.drafter import families
    from dflash_ray.plots import acceptance_png

    target, trained, drafter = cfg.pipeline.target, run.results["train"][name], run.results["export"][name]
    tag = f"[{name}]" if name else ""
    # vLLM's own acceptance of the exported drafter, on the same prompts, where vLLM serves its family
    served = families.get(cfg.train.drafter).vllm_on_cpu or torch.cuda.is_available()
    engine = "vllm" if cfg.pipeline.vllm_evaluate and served and importlib.util.find_spec("vllm") else "hf"
    # the plot goes beside the training output this pipeline made (`TRAINING_FILES`), not a folder of its own
    after = run.timed(
        f"evaluate_trained{tag}",
        _evaluate,
        drafter,
        target,
        run.at("prompts-eval"),
        cfg,
        heldout_uri=None,
        engine=engine,
        tokenizer_name=None,
        sampled=True,
        reference_cache=references,
        report_dir=folder,
    )
    unseen = {}
    if cfg.pipeline.unseen_prompts:  # prompts of other kinds: never generated for, trained on or tuned on
        result = run.timed(
            f"evaluate_unseen{tag}",
            run_evaluate,
            drafter,
            target,
            run.at("prompts-unseen"),
            cfg,
            sampled=False,
            reference_cache=references,
        )
        unseen_png = storage.join(folder, "evaluation-unseen.png")
        storage.write_bytes(unseen_png, acceptance_png(result))
        unseen = {
            "unseen": {
                "prompts": result["prompts"],
                "tau_trained": result["tau"],
                "tau_ngram": result["tau_ngram"],
                "tau_per_source": result["tau_per_source"],
                "tau_ngram_per_source": result["tau_ngram_per_source"],
                "acceptance_by_position": result["acceptance_by_position"],
                "ngram_acceptance_by_position": result["ngram_acceptance_by_position"],
                "first_position": first_position(result["acceptance_by_position"]),
                "ngram_first_position": first_position(result["ngram_acceptance_by_position"]),
                "evaluation_png": unseen_png,
                "lossless": result["lossless"],
            }
        }
    start, end = trained["heldout_tau_start"], trained["heldout_tau"]
    return {
        **unseen,
        "family": cfg.train.drafter,
        "train_loss": trained["loss"],
        "heldout_tau_start": start,
        "heldout_tau_end": end,
        # what training gained, on held-out samples: the simulated tau at the end against step 0's
        "tau_gain": None if start is None or end is None else round(end - start, 4),
        "tau_trained": after["tau"],
        "tau_ngram": after["tau_ngram"],
        "tau_trained_sampled": after["tau_sampled"],
        "acceptance_by_position": after["acceptance_by_position"],
        # the first draft, which every later one waits on, as its own figure
        "first_position": first_position(after["acceptance_by_position"]),
        "ngram_first_position": first_position(after["ngram_acceptance_by_position"]),
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
        "lossless": after["lossless"] and unseen.get("unseen", {}).get("lossless", True),
        "plots": storage.join(folder, "metrics.png"),
        "drafter": drafter,
    }


STAGES = (
    Stage(
        name="evaluate",
        help="acceptance length of a drafter against its target",
        command=_command,
        arguments=_arguments,
        section="evaluate",
        order=70,
        inputs=("drafter", "prompts-eval", "prompts-unseen"),
        step=_step,
    ),
)
