"""`dflash-ray demo`: the pipeline on the embedded default, on one machine, local storage.

Stages that exist today: prompts (the bundled, varied prompt set, bad records included) →
completions → Ray Data tokenization with the SmolLM2-135M-Instruct tokenizer → validation gate.
Until the generation stage exists, the completions are the bundled records' own reference answers,
and the summary says so.
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
    }
