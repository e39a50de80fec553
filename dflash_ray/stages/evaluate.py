"""`dflash-ray evaluate`: acceptance length of a drafter against its target, measured for real.

For each prompt the target decodes greedily alone and with the drafter (speculative decoding);
the two outputs must be equal token for token, and the run says so. Reported: tau (tokens
committed per verify step) overall and per prompt source, tokens/s of both; tau at the serving
temperature and top-p (`evaluate.temperature`, `evaluate.top_p`) under the speculative-sampling
rule; the n-gram prompt-lookup baseline on the same outputs as tokens per target forward (`tau_ngram`,
comparable with tau) and per proposed draft (`tau_ngram_per_draft`, vLLM's definition) with the
share of steps that had a draft; and the simulated tau on a tokenized held-out set (the figure
training reports). `--engine vllm` adds vLLM's own measured acceptance length.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
from typing import Any

from dflash_ray import manifest
from dflash_ray.config import RunConfig
from dflash_ray.errors import DFlashError
from dflash_ray.drafter.vllm_check import vllm_decode
from dflash_ray.stages import PipelineRun, Stage

log = logging.getLogger(__name__)


def _prompt_rows(uri: str, limit: int) -> list[dict[str, Any]]:
    """The prompts to measure on. A conversation that generation answers turn by turn is measured on
    its first turn: its later turns need the target's own earlier answers in the history."""
    from dflash_ray.generation.completions import Conversation

    rows = manifest.read_rows(uri, None, limit)  # all columns: `regenerate` is absent from older shards
    if not rows:
        raise DFlashError("no prompts", file=uri)
    return [{**row, "messages": Conversation.of(row).history} for row in rows]


def _heldout_tau(target, drafter, embed, head, uri: str, cfg: RunConfig) -> float | None:
    import torch

    from dflash_ray.drafter import families
    from dflash_ray.target_model.capture import target_features

    ecfg = cfg.evaluate
    forward_loss = families.get(drafter.cfg.family).forward_loss
    taus: list[float] = []
    g = torch.Generator().manual_seed(ecfg.seed)
    for row in manifest.read_rows(uri, ["input_ids", "loss_mask"], ecfg.num_heldout):
        ids = torch.tensor([row["input_ids"]], device=head.device)
        mask = torch.tensor([row["loss_mask"]], device=head.device)
        feats = target_features(target, ids, drafter.cfg.target_layer_ids)
        with torch.no_grad():
            out = forward_loss(
                drafter, embed, head, feats.to(embed.dtype), ids, mask, num_anchors=ecfg.num_anchors, generator=g
            )
        taus += out.tau.tolist()
    return sum(taus) / len(taus) if taus else None


def _within_context(
    rows: list[dict[str, Any]], tokenizer, ecfg, context: int | None, prompts_uri: str
) -> tuple[list[tuple[dict[str, Any], list[int]]], list[int]]:
    """Each row with its prompt's tokens, those whose decoding fits the target's `context` positions
    (the prompt and `evaluate.max_new_tokens`), and the lengths of those that do not: every prompt is
    measured before any decoding, and what is left out is said, not decoded for minutes past the
    positions the target was made for."""
    kept, skipped = [], []
    for row in rows:
        tools = json.loads(row["tools"]) if row.get("tools") else None
        text = tokenizer.apply_chat_template(
            row["messages"],
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=ecfg.enable_thinking,
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if context is not None and len(ids) + ecfg.max_new_tokens > context:
            skipped.append(len(ids))
        else:
            kept.append((row, ids))
    if skipped:
        what = (
            f"{len(skipped)} of {len(rows)} prompts (up to {max(skipped)} tokens) with evaluate.max_new_tokens="
            f"{ecfg.max_new_tokens} pass the target's {context} positions (its max_position_embeddings)"
        )
        if not kept:
            raise DFlashError(
                f"{what}: none is left to measure; lower evaluate.max_new_tokens or give shorter prompts",
                file=prompts_uri,
                field="evaluate.max_new_tokens",
            )
        log.warning("%s: skipped, not decoded (the summary's prompts_skipped)", what)
    return kept, skipped


def evaluation_device(setting: str, cuda_available: bool) -> str:
    """`auto`: the GPU when this process sees one (the target, drafter and decoding loop all go there)."""
    if setting == "cuda" and not cuda_available:
        raise DFlashError("evaluate.device=cuda but CUDA sees no GPU here", field="evaluate.device")
    return "cuda" if setting == "cuda" or (setting == "auto" and cuda_available) else "cpu"


@dataclasses.dataclass
class _Models:
    """The target, the drafter and what decoding needs of them, loaded once for every prompt."""

    device: str
    target_dir: str
    drafter_dir: str
    tokenizer: Any
    drafter: Any
    target: Any
    text_cfg: Any
    embed: Any
    head: Any
    eos: set[int]
    num_drafts: int  # the n-gram baseline drafts as many tokens a step as the drafter does


@dataclasses.dataclass
class _Tally:
    """What decoding the prompts measured, gathered prompt by prompt for the summary."""

    per_source: dict[str, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    ngram_per_source: dict[str, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(list))
    all_steps: list[int] = dataclasses.field(default_factory=list)
    sampled_steps: list[int] = dataclasses.field(default_factory=list)
    ngram_steps: list[Any] = dataclasses.field(default_factory=list)
    prompt_ids: list[list[int]] = dataclasses.field(default_factory=list)
    references: list[list[int]] = dataclasses.field(default_factory=list)
    verified: list[Any] = dataclasses.field(default_factory=list)  # (drafted, accepted) per verify step
    verified_sampled: list[Any] = dataclasses.field(default_factory=list)
    spec_s: float = 0.0
    base_s: float = 0.0
    tokens: int = 0
    mismatches: int = 0


def _check_inputs(prompts_uri: str, heldout_uri: str | None, report_dir: str | None) -> None:
    """Wrong inputs fail here, before minutes of loading models."""
    manifest.require_columns(prompts_uri, ["messages"], "--prompts (a prompts dataset)")
    if report_dir is not None:
        from dflash_ray import storage

        storage.require_folder(report_dir)
    if heldout_uri:
        manifest.require_columns(heldout_uri, ["input_ids", "loss_mask"], "--heldout (a tokenized dataset)")


def _load_models(drafter_uri: str, target_uri: str, tokenizer_name: str | None, ecfg) -> _Models:
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_ray.drafter import families
    from dflash_ray.drafter.export import load_drafter
    from dflash_ray.registry import load_tokenizer, resolve, stop_token_ids
    from dflash_ray.target_model.capture import load_embed_and_head

    dtype = getattr(torch, ecfg.dtype)
    device = evaluation_device(ecfg.device, torch.cuda.is_available())
    target_dir, drafter_dir = resolve(target_uri), resolve(drafter_uri)
    tokenizer = load_tokenizer(tokenizer_name or target_uri)
    # transformers types its wrapped `to` as if unbound (the model first)
    try:
        drafter = load_drafter(drafter_dir).to(device, dtype).eval()
    except ValueError as e:  # no drafter family's config.json, or weights that do not fit it
        raise DFlashError(f"not a drafter this project exports: {e}", file=drafter_uri) from None
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]
    text_cfg = target.config.get_text_config()
    _check_same_target(drafter, target, text_cfg, tokenizer, drafter_uri)
    embed, head = (t.to(device, dtype) for t in load_embed_and_head(target_dir))
    num_drafts = drafter.cfg.block_size - families.get(drafter.cfg.family).first_prediction
    return _Models(
        device=device,
        target_dir=target_dir,
        drafter_dir=drafter_dir,
        tokenizer=tokenizer,
        drafter=drafter,
        target=target,
        text_cfg=text_cfg,
        embed=embed,
        head=head,
        eos=set(stop_token_ids(tokenizer)),
        num_drafts=num_drafts,
    )


def _check_same_target(drafter, target, text_cfg, tokenizer, drafter_uri: str) -> None:
    """A drafter or tokenizer of another target decodes, but what it measures means nothing."""
    rows_of_embedding = target.get_input_embeddings().num_embeddings
    theirs = {k: getattr(text_cfg, k, None) for k in ("vocab_size", "hidden_size")}
    theirs["num_target_layers"] = getattr(text_cfg, "num_hidden_layers", None)
    wrong = [
        f"{k} {getattr(drafter.cfg, k)} (the target's: {v})" for k, v in theirs.items() if v != getattr(drafter.cfg, k)
    ]
    if wrong:
        raise DFlashError(f"a drafter of another target: its config.json gives {', '.join(wrong)}", file=drafter_uri)
    if len(tokenizer) > rows_of_embedding:
        raise DFlashError(
            f"the tokenizer has {len(tokenizer)} ids, past the target's {rows_of_embedding}-entry "
            "embedding: it is not the target's",
            field="--tokenizer",
        )


def _decode_prompts(
    models: _Models, encoded: list[tuple[dict[str, Any], list[int]]], ecfg, target_uri: str, sampled: bool, cache: dict
) -> _Tally:
    """Each prompt decoded by the target alone (or taken from `cache`), with the drafter, by prompt
    lookup on the same output, and at the serving temperature: every figure of one prompt comes
    from the same reference output."""
    import torch
    from tqdm import tqdm

    from dflash_ray.drafter import ngram
    from dflash_ray.drafter.speculative import Sampling, speculative_decode, target_decode

    tally = _Tally()
    generator = torch.Generator(device=models.device).manual_seed(ecfg.seed)
    for row, ids in tqdm(encoded, desc="evaluate", unit=" prompts"):
        tally.prompt_ids.append(ids)
        key = (target_uri, ecfg.max_new_tokens, tuple(ids))
        if key not in cache:
            cache[key] = target_decode(models.target, ids, ecfg.max_new_tokens, models.eos)
        ref = cache[key]
        tally.references.append(ref.token_ids)
        spec = speculative_decode(
            models.target, models.drafter, models.embed, models.head, ids, ecfg.max_new_tokens, models.eos
        )
        tally.mismatches += int(spec.token_ids != ref.token_ids)
        tally.per_source[row["source"]] += spec.acceptance
        tally.all_steps += spec.acceptance
        tally.verified += spec.verified
        lookup = ngram.simulate_steps(ids, ref.token_ids, models.num_drafts, ecfg.ngram_min, ecfg.ngram_max)
        tally.ngram_steps += lookup
        tally.ngram_per_source[row["source"]] += [step.commit for step in lookup]
        if sampled and ecfg.temperature > 0:  # at the serving temperature: the speculative-sampling rule
            sampling = Sampling(ecfg.temperature, ecfg.top_p, generator)
            drawn = speculative_decode(
                models.target, models.drafter, models.embed, models.head, ids, ecfg.max_new_tokens, models.eos, sampling
            )
            tally.sampled_steps += drawn.acceptance
            tally.verified_sampled += drawn.verified
        tally.spec_s += spec.seconds
        tally.base_s += ref.seconds
        tally.tokens += len(ref.token_ids)
    return tally


def _mean(xs):
    return round(sum(xs) / len(xs), 4) if xs else None


def _summary(
    tally: _Tally, drafter_uri: str, target_uri: str, device: str, prompts: int, skipped: int, context, ecfg
) -> dict[str, Any]:
    """The figures of every prompt together; the drafter's tau beside prompt lookup's on the same outputs."""
    from dflash_ray.drafter.speculative import acceptance_by_position

    ngram_steps = tally.ngram_steps
    return {
        "stage": "evaluate",
        "drafter": drafter_uri,
        "target": target_uri,
        "device": device,
        "prompts": prompts,
        # prompts whose tokens and evaluate.max_new_tokens pass the target's positions: not decoded
        "prompts_skipped": skipped,
        "context": context,
        "tokens": tally.tokens,
        "tau": _mean(tally.all_steps),
        "verify_steps": len(tally.all_steps),
        "tau_per_source": {s: _mean(v) for s, v in sorted(tally.per_source.items())},
        "acceptance_by_position": acceptance_by_position(tally.verified),
        "tau_sampled": _mean(tally.sampled_steps),
        "acceptance_by_position_sampled": acceptance_by_position(tally.verified_sampled),
        "sampling": {"temperature": ecfg.temperature, "top_p": ecfg.top_p},
        "tau_ngram": _mean([step.commit for step in ngram_steps]),
        "tau_ngram_per_source": {s: _mean(v) for s, v in sorted(tally.ngram_per_source.items())},
        "ngram_acceptance_by_position": acceptance_by_position(
            [(s.drafted, s.accepted) for s in ngram_steps if s.drafted]
        ),
        "tau_ngram_per_draft": _mean([step.commit for step in ngram_steps if step.drafted]),
        "ngram_draft_share": round(sum(s.drafted > 0 for s in ngram_steps) / len(ngram_steps), 4)
        if ngram_steps
        else None,
        "tokens_per_s": round(tally.tokens / tally.spec_s, 2) if tally.spec_s else None,
        "target_tokens_per_s": round(tally.tokens / tally.base_s, 2) if tally.base_s else None,
        "speedup": round(tally.base_s / tally.spec_s, 3) if tally.spec_s else None,
        "lossless": tally.mismatches == 0,
        "mismatched_prompts": tally.mismatches,
    }


def _add_vllm(summary: dict[str, Any], models: _Models, tally: _Tally, ecfg) -> None:
    """vLLM's own acceptance on the same prompts, and whether it decodes the target's outputs."""
    result = vllm_decode(
        models.target_dir, models.drafter_dir, tally.prompt_ids, ecfg.max_new_tokens, ecfg.temperature, ecfg.top_p
    )
    summary["tau_vllm"] = result["acceptance_length"]
    summary["tau_vllm_sampled"] = result.get("sampled", {}).get("acceptance_length")
    summary["vllm_outputs_equal"] = result["outputs"] == tally.references


def _write_report(summary: dict[str, Any], report_dir: str) -> None:
    from dflash_ray import storage
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
    (acceptance by draft position and by prompt source, the drafter beside prompt lookup)."""
    _check_inputs(prompts_uri, heldout_uri, report_dir)  # before any model loads
    ecfg = cfg.evaluate
    models = _load_models(drafter_uri, target_uri, tokenizer_name, ecfg)
    rows = _prompt_rows(prompts_uri, ecfg.num_prompts)
    context = getattr(models.text_cfg, "max_position_embeddings", None)
    encoded, skipped = _within_context(rows, models.tokenizer, ecfg, context, prompts_uri)
    cache = reference_cache if reference_cache is not None else {}
    tally = _decode_prompts(models, encoded, ecfg, target_uri, sampled, cache)
    summary = _summary(tally, drafter_uri, target_uri, models.device, len(encoded), len(skipped), context, ecfg)
    if heldout_uri:
        summary["tau_simulated_heldout"] = _heldout_tau(
            models.target, models.drafter, models.embed, models.head, heldout_uri, cfg
        )
    if engine == "vllm":
        _add_vllm(summary, models, tally, ecfg)
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
    p.add_argument("--drafter", required=True, metavar="DIR")
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

    from dflash_ray import storage
    from dflash_ray.drafter import families
    from dflash_ray.plots import acceptance_png

    target, trained, drafter = cfg.pipeline.target, run.results["train"][name], run.results["export"][name]
    tag = f"[{name}]" if name else ""
    # vLLM's own acceptance of the exported drafter, on the same prompts, where vLLM serves its family
    served = families.get(cfg.train.drafter).vllm_on_cpu or torch.cuda.is_available()
    engine = "vllm" if cfg.pipeline.vllm_evaluate and served and importlib.util.find_spec("vllm") else "hf"
    after = run.timed(
        f"evaluate_trained{tag}",
        run_evaluate,
        drafter,
        target,
        run.at("prompts-eval"),
        cfg,
        engine=engine,
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
