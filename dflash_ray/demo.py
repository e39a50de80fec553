"""`dflash-ray demo`: the pipeline on the embedded default, on one machine, local storage.

Stages: prompts (the bundled, varied prompt set, bad records included) → completions → Ray Data
tokenization with the SmolLM2-135M-Instruct tokenizer → validation gate → online training with 2
streams → evaluation of the untrained and the trained drafter → export. Until the generation stage
exists, the completions are the bundled records' own reference answers, and the summary says so.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_ray import storage
from dflash_ray.config import RunConfig
from dflash_ray.data.formats import BadRecord, normalize
from dflash_ray.data.records import iter_records
from dflash_ray.registry import SMOLLM2

DEMO_FILES = ("demo_chats.jsonl", "demo_sharegpt.jsonl", "demo_alpaca.jsonl")


def bundled_inputs() -> list[str]:
    folder = resources.files("dflash_ray.assets")
    return [str(folder / name) for name in DEMO_FILES]


def _first_answer(record: dict[str, Any]) -> str | None:
    if "output" in record:
        return record["output"]
    for msg in record.get("messages") or record.get("conversations") or []:
        if msg.get("role", msg.get("from")) in ("assistant", "gpt"):
            return msg.get("content", msg.get("value"))
    return None


def reference_completions(inputs: list[str], output: str, multi_turn: str) -> int:
    """Completion records whose responses are the datasets' own first answers (a stand-in)."""
    rows = {}
    for uri in inputs:
        source = storage.basename(uri).rsplit(".", 1)[0]
        for item in iter_records(uri):
            if item.error is not None:
                continue
            try:
                prompts = normalize(item.record, multi_turn)
            except BadRecord:
                continue
            answer = _first_answer(item.record)
            for p in prompts[:1]:
                if answer:
                    rows[p.id] = {**p.row(source), "text": answer, "reasoning": None,
                                  "finish_reason": "stop"}
    storage.write_text(storage.join(output, "completions.jsonl"),
                       "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows.values()))
    return len(rows)


def run_demo(workdir: str, cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    import dataclasses

    from dflash_ray.data.prompts import run_prompts
    from dflash_ray.data.validate import run_validate
    from dflash_ray.stages.tokenize import run_tokenize

    work = Path(workdir).absolute()
    started = time.time()
    cfg = dataclasses.replace(
        cfg, prompts=dataclasses.replace(cfg.prompts, tokenizer=SMOLLM2),
        tokenize=dataclasses.replace(cfg.tokenize, tokenizer=SMOLLM2))
    inputs = bundled_inputs()
    prompts = run_prompts(inputs, str(work / "prompts"), cfg, progress=progress)
    completions = reference_completions(inputs, str(work / "completions"), cfg.prompts.multi_turn)
    tokenized = run_tokenize(str(work / "completions"), str(work / "tokenized"), cfg)
    report = run_validate(str(work / "tokenized"), cfg, report_dir=str(work / "report"))
    trained = _train_and_evaluate(work, cfg, progress)
    return {
        "stage": "demo", "workdir": str(work), "seconds": round(time.time() - started, 1),
        "records": prompts["records"], "prompts": prompts["prompts"],
        "quarantined": prompts["quarantined"], "quarantine_kinds": prompts["quarantine_kinds"],
        "completions": completions, "completions_from": "bundled reference answers (generation stage not built yet)",
        "samples": tokenized["rows_out"], "tokens": tokenized["tokens"],
        "loss_tokens": report["stats"]["loss_tokens"],
        "response_fraction": round(report["stats"]["response_fraction"], 4),
        "loss_mask_sum_median": report["stats"]["loss_mask_sum"]["median"],
        "gate_passed": report["passed"], "failed_rules": report["failed_rules"],
        "report": str(work / "report" / "report.md"),
        **trained,
    }


# the demo's training: two streams share this machine's cores
DEMO_TRAIN = ["train.num_streams=2", "train.actor_cpus=0.5", "train.num_layers=1", "train.num_anchors=32",
              "train.epochs=3", "train.lr=2e-3", "train.checkpoint_every=1000", "train.heldout=8",
              "train.eval_every=8", "evaluate.num_prompts=6", "evaluate.max_new_tokens=48"]


def _train_and_evaluate(work: Path, cfg: RunConfig, progress: bool) -> dict[str, Any]:
    import shutil

    import torch

    from dflash_ray.config import apply_override, config_from_dict
    from dflash_ray.drafter.export import export_checkpoint, from_hf_config, save_drafter
    from dflash_ray.drafter.model import DFlashDrafter
    from dflash_ray.evaluate import run_evaluate
    from dflash_ray.train.coordinator import drafter_config, run_train

    data = cfg.to_dict()
    for assignment in DEMO_TRAIN:
        apply_override(data, assignment)
    cfg = config_from_dict(data)
    shutil.rmtree(work / "train", ignore_errors=True)  # the demo is a fresh run every time
    train = run_train(SMOLLM2, str(work / "tokenized"), str(work / "train"), cfg, progress=progress)
    export_checkpoint(train["checkpoint"], str(work / "drafter"), dtype="float32")
    torch.manual_seed(cfg.train.seed)  # the same initialization training started from
    untrained = DFlashDrafter(from_hf_config(drafter_config(SMOLLM2, cfg)))
    save_drafter(untrained, work / "drafter-untrained", dtype=torch.float32)
    before = run_evaluate(str(work / "drafter-untrained"), SMOLLM2, str(work / "prompts"), cfg)
    after = run_evaluate(str(work / "drafter"), SMOLLM2, str(work / "prompts"), cfg)
    return {
        "training_steps": train["step"], "train_loss": train["loss"],
        "heldout_tau_start": train["heldout_tau_first"], "heldout_tau_end": train["heldout_tau"],
        "tau_untrained": before["tau"], "tau_trained": after["tau"], "tau_ngram": after["tau_ngram"],
        "spec_tokens_per_s": after["tokens_per_s"], "target_tokens_per_s": after["target_tokens_per_s"],
        "lossless": before["lossless"] and after["lossless"],
        "plots": str(work / "train" / "metrics.png"), "drafter": str(work / "drafter"),
    }
