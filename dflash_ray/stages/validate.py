"""`dflash-ray validate`: the statistics of `data.validate` over a whole tokenized dataset, the gate's
verdict, and the report (JSON, Markdown, histograms) written where asked. The caller enforces the gate."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from dflash_ray import storage, writer
from dflash_ray.config import RunConfig, TokenizeConfig
from dflash_ray.data.tokenized import open_tokenized
from dflash_ray.data.validate import (
    TOP_VALUES,
    bound_stats,
    distribution,
    examples,
    gate_rules,
    histogram_png,
    markdown,
    scan,
)
from dflash_ray.errors import DFlashError, GateFailed
from dflash_ray.stages import PipelineRun, Stage


def _trust_named_tokenizer(name: Any, input_uri: str) -> None:
    """A tokenizer the dataset's manifest names is loaded only by short name or Hub id: a path (on
    this machine or S3) is a place the file chose, which only the user may choose (`--tokenizer`)."""
    from dflash_ray import storage
    from dflash_ray.registry import HUB_ID, SHORT_NAMES

    if isinstance(name, str) and name in SHORT_NAMES:
        return
    if isinstance(name, str) and HUB_ID.fullmatch(name) and not storage.local_path(name.removeprefix("hf://")).exists():
        return  # a Hub id: read from the Hub's cache, never a folder of that name here
    raise DFlashError(
        f"the dataset's manifest names the tokenizer {str(name)[:200]!r}, a path it chose: a manifest may "
        "name a short name or a Hub id; nothing was loaded: pass --tokenizer NAME_OR_PATH if you trust it",
        file=input_uri,
        field="tokenize.tokenizer",
    )


def _earlier_report(report_dir: str) -> bool:
    """A report folder an earlier version wrote, unmarked: its report.json is a validation's."""
    try:
        return json.loads(storage.read_text(storage.join(report_dir, "report.json"))).get("stage") == "validate"
    except (FileNotFoundError, NotADirectoryError, ValueError, AttributeError):
        return False


def run_validate(
    input_uri: str, cfg: RunConfig, *, report_dir: str | None = None, tokenizer_name: str | None = None
) -> dict[str, Any]:
    """Compute the report, write it (when `report_dir`: a folder of its own, held while the dataset
    is read and the report written), and return it; the caller enforces the gate."""
    if report_dir is None:
        return _validate(input_uri, cfg, None, tokenizer_name)
    if storage.overlaps(input_uri, report_dir):
        raise DFlashError(
            f"the report folder and the input {input_uri} overlap (one is, or is inside, the other): the report "
            "would be written among the dataset's files; give a report folder of its own",
            file=report_dir,
            field="--report",
        )
    with writer.output(report_dir, "validation-report", ours_if=lambda: _earlier_report(report_dir)):
        return _validate(input_uri, cfg, report_dir, tokenizer_name)


def _validate(input_uri: str, cfg: RunConfig, report_dir: str | None, tokenizer_name: str | None) -> dict[str, Any]:
    from dflash_ray.registry import load_tokenizer

    vcfg = cfg.validate
    data = open_tokenized(input_uri)
    made_by = data.made_by or {}
    set_in_config = cfg.tokenize.tokenizer if cfg.tokenize.tokenizer != TokenizeConfig().tokenizer else None
    named = made_by.get("config", {}).get("tokenize", {}).get("tokenizer")
    if not (tokenizer_name or set_in_config) and named:
        _trust_named_tokenizer(named, input_uri)
    tokenizer_name = tokenizer_name or named or set_in_config
    if not tokenizer_name:  # a guess would decode the report's samples into garbage, and check ids against it
        raise DFlashError(
            "the dataset's manifest names no tokenizer (it was not tokenized here): give the one "
            "that made its ids with --tokenizer NAME_OR_PATH",
            file=input_uri,
            field="tokenize.tokenizer",
        )
    tokenizer = load_tokenizer(tokenizer_name)
    found = scan(data, tokenizer)
    n = int(found.loss_sums.size)
    if n == 0:
        raise DFlashError("the dataset holds no samples", file=input_uri)
    values, counts = np.unique(found.loss_sums, return_counts=True)
    order = np.argsort(-counts, kind="stable")[:TOP_VALUES]
    tokens, loss_tokens = int(found.seq_lens.sum()), int(found.loss_sums.sum())
    all_loss = (found.loss_sums == found.seq_lens) & (found.seq_lens > 0)
    duplicate = found.first_copy != np.arange(n)
    stats = {
        "samples": n,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "response_fraction": loss_tokens / max(tokens, 1),
        "loss_mask_sum": {
            **distribution(found.loss_sums),
            "most_common": [
                {"value": int(values[i]), "count": int(counts[i]), "share": float(counts[i] / n)} for i in order
            ],
        },
        "seq_len": distribution(found.seq_lens),
        "no_loss_share": float((found.loss_sums == 0).mean()),
        "prompt_loss_share": float(found.prompt_loss.mean()),
        "all_loss_share": float(all_loss.mean()),
        "duplicates": int(duplicate.sum()),
        "duplicate_share": float(duplicate.mean()),
        # what `tokenize` dropped as copies before this dataset was written, from its manifest
        "duplicates_dropped": (made_by.get("summary") or {}).get("duplicates"),
        "empty_thinking_share": (found.empty_thinking / n) if "<think>" in tokenizer.get_vocab() else None,
        "offline_storage_bytes": vcfg.num_feature_layers * vcfg.hidden_size * 2 * tokens,
        "sources": {
            src: {"samples": int(c), "median_response": float(np.median(np.concatenate(found.source_loss[src])))}
            for src, c in found.sources.most_common()
        },
        "mask_bounds": bound_stats(found, tokenizer, "id" in data.columns),  # the boundary rules' figures
    }
    rules = gate_rules(stats, vcfg.gate)
    has_id = "id" in data.columns
    mask_examples = examples(
        found, np.flatnonzero(found.prompt_loss | all_loss)[: vcfg.num_examples].tolist(), tokenizer, has_id
    )
    for rule in rules:  # a misplaced mask is shown decoded: the prompt's words among the loss tokens
        flagged = {"prompt_loss": found.prompt_loss, "all_loss": all_loss}.get(rule["rule"])
        if flagged is not None and flagged.any():
            ex = examples(found, [int(np.argmax(flagged))], tokenizer, has_id)[0]
            rule["message"] += f"; e.g. {ex['id']}, whose loss tokens read {ex['response'][:200]!r}"
        if rule["rule"] == "duplicates" and duplicate.any():  # the first copy, and what it copies
            k = int(np.argmax(duplicate))
            copy, of = examples(found, [k, int(found.first_copy[k])], tokenizer, has_id)
            rule["message"] += f"; e.g. {copy['id']} repeats {of['id']}"
    rng = np.random.default_rng(vcfg.seed)
    mode = int(values[order[0]])
    dominant = np.flatnonzero(found.loss_sums == mode)[: vcfg.num_examples].tolist()
    random_rows = sorted(rng.choice(n, size=min(n, vcfg.num_examples), replace=False).tolist())
    report = {
        "stage": "validate",
        "input": input_uri,
        "tokenizer": tokenizer_name,
        "passed": all(r["passed"] for r in rules),
        "failed_rules": [r["rule"] for r in rules if not r["passed"]],
        "rules": rules,
        "stats": stats,
        "dominant_examples": examples(found, dominant, tokenizer, "id" in data.columns),
        "random_examples": examples(found, random_rows, tokenizer, "id" in data.columns),
        "mask_examples": mask_examples,
    }
    if report_dir:
        storage.write_text(storage.join(report_dir, "report.json"), json.dumps(report, indent=1))
        storage.write_text(storage.join(report_dir, "report.md"), markdown(report))
        storage.write_bytes(
            storage.join(report_dir, "loss_mask_sum.png"),
            histogram_png(found.loss_sums, "Response tokens per sample (loss-mask sum)", "loss-mask sum"),
        )
        storage.write_bytes(
            storage.join(report_dir, "seq_len.png"), histogram_png(found.seq_lens, "Sequence length", "tokens")
        )
        report["report_dir"] = report_dir
    return report


def _command(args: argparse.Namespace, cfg: RunConfig) -> dict[str, Any]:
    report = run_validate(args.input, cfg, report_dir=args.report, tokenizer_name=args.tokenizer)
    summary = {k: report[k] for k in ("stage", "input", "tokenizer", "passed", "failed_rules", "rules")}
    summary["stats"] = {k: v for k, v in report["stats"].items() if k != "sources"}
    summary["report_dir"] = report.get("report_dir")
    _enforce(report, args.input, summary)
    return summary


def _enforce(report: dict[str, Any], data: str, summary: dict[str, Any]) -> None:
    """The gate: a failed rule stops here (exit 3), with the summary so far."""
    if not report["passed"]:
        failed = "; ".join(f"{r['rule']}: {r['message']}" for r in report["rules"] if not r["passed"])
        raise GateFailed(f"validation gate failed: {failed}", file=data).with_summary(summary)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--input",
        required=True,
        metavar="URI",
        help="tokenized dataset (input_ids, loss_mask): a Parquet file, a folder of Parquet files "
        "(from `dflash-ray tokenize` or not), or a Hugging Face `save_to_disk` folder",
    )
    p.add_argument("--report", metavar="DIR", help="write report.json, report.md and PNG histograms here")
    p.add_argument("--tokenizer", metavar="NAME_OR_PATH", help="default: the one that tokenized the data")


def _step(run: PipelineRun) -> dict[str, Any]:
    """The gate before any training: a failed rule ends the pipeline here (exit 3)."""
    report = run.timed("validate", run_validate, run.at("tokenized"), run.cfg, report_dir=run.at("report"))
    part = {
        "loss_tokens": report["stats"]["loss_tokens"],
        "response_fraction": round(report["stats"]["response_fraction"], 4),
        "loss_mask_sum_median": report["stats"]["loss_mask_sum"]["median"],
        "gate_passed": report["passed"],
        "failed_rules": report["failed_rules"],
        "report": run.at("report/report.md"),
    }
    _enforce(report, run.at("tokenized"), {**run.summary, **part})
    return part


STAGES = (
    Stage(
        name="validate",
        help="loss-mask statistics and the validation gate",
        command=_command,
        arguments=_arguments,
        section="validate",
        order=40,
        inputs=("tokenized",),
        outputs=("report",),
        step=_step,
    ),
)
