"""`dflash-ray prompts`: raw chat datasets → normalized, deduplicated prompt shards.

Output folder: `prompts-RUN-NNNNN.parquet` (schema `PROMPTS`), `quarantine.jsonl` (one line per
bad record: file, line (and item, for an element of a JSON array), kind, reason, raw record) and
`_manifest.json`, written last. One bad record never stops the run, nor does a file that cannot be
read (one quarantine entry): every record read ends up either in a shard, in quarantine, or counted
as a duplicate (`records` = `records_ok` + `quarantined`). A run that yields no prompt is an error.
A rerun replaces an earlier run's output only when it is complete (see `manifest.commit`).
"""

from __future__ import annotations

import collections
import io
import json
import uuid
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray import manifest, storage
from dflash_ray.config import RunConfig
from dflash_ray.data import schema
from dflash_ray.data.formats import BadRecord, Prompt, normalize
from dflash_ray.data.records import SUFFIXES, RawRecord, iter_records, raw_preview
from dflash_ray.errors import DFlashError

QUARANTINE = "quarantine.jsonl"


def input_files(inputs: Iterable[str]) -> list[str]:
    files: list[str] = []
    for uri in inputs:
        files += manifest.dataset_files(uri, SUFFIXES)
    return files


class PromptBudget:
    """Counts a prompt's tokens as the target will see them: chat template, tools, generation header."""

    def __init__(self, tokenizer_name: str, max_tokens: int):
        from dflash_ray.registry import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_name)
        self.max_tokens = max_tokens

    def check(self, prompt: Prompt) -> None:
        tools = json.loads(prompt.tools) if prompt.tools else None
        try:
            text = self.tokenizer.apply_chat_template(prompt.messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # jinja errors carry no common base class
            raise BadRecord(f"chat template error: {e}", "template_error") from None
        count = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if count > self.max_tokens:
            raise BadRecord(f"prompt has {count} tokens, over the budget of {self.max_tokens}",
                            "over_budget")


def shard_bytes(rows: list[dict[str, Any]]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema.PROMPTS), sink)
    return sink.getvalue()


def run_prompts(inputs: list[str], output: str, cfg: RunConfig, *, progress: bool = True) -> dict[str, Any]:
    pcfg = cfg.prompts
    files = input_files(inputs)
    budget = PromptBudget(pcfg.tokenizer, pcfg.max_prompt_tokens) if pcfg.max_prompt_tokens > 0 else None
    prefix = f"prompts-{uuid.uuid4().hex[:8]}"  # this run's shards: an earlier run's stay whole until commit

    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    shards: list[dict[str, Any]] = []
    quarantine: list[str] = []
    kinds: collections.Counter[str] = collections.Counter()
    counts = collections.Counter()

    def flush() -> None:
        name = f"{prefix}-{len(shards):05d}.parquet"
        storage.write_bytes(storage.join(output, name), shard_bytes(rows))
        shards.append({"name": name, "rows": len(rows)})
        rows.clear()

    def quarantined(item: RawRecord, error: BadRecord) -> None:
        kinds[error.kind] += 1
        quarantine.append(json.dumps({**item.where(), "kind": error.kind, "reason": str(error),
                                      "record": raw_preview(item)}, ensure_ascii=False))

    from tqdm import tqdm

    bar = tqdm(desc="prompts", unit=" records", disable=not progress)
    for uri in files:
        source = storage.basename(uri).rsplit(".", 1)[0]
        for item in iter_records(uri):
            counts["records"] += 1
            bar.update(1)
            if item.error is not None:
                quarantined(item, item.error)
                continue
            try:
                prompts = normalize(item.record, pcfg.multi_turn)
                for prompt in prompts:
                    if budget is not None:
                        budget.check(prompt)
            except BadRecord as error:
                quarantined(item, error)
                continue
            counts["records_ok"] += 1
            for prompt in prompts:
                if prompt.id in seen:
                    counts["duplicates"] += 1
                    continue
                seen.add(prompt.id)
                rows.append(prompt.row(source))
                if len(rows) >= pcfg.shard_size:
                    flush()
    bar.close()
    summary = {
        "stage": "prompts", "output": output, "input_files": len(files),
        # every record read is quarantined or makes prompts: records = records_ok + quarantined
        "records": counts["records"], "records_ok": counts["records_ok"], "prompts": len(seen),
        "duplicates": counts["duplicates"], "quarantined": len(quarantine),
        "quarantine_kinds": dict(sorted(kinds.items())), "quarantine_file": storage.join(output, QUARANTINE),
        "shards": len(shards) + bool(rows),
    }
    report = "".join(line + "\n" for line in quarantine)
    if not seen:
        summary["quarantine_file"] = manifest.report_uri(output, QUARANTINE)
        storage.write_text(summary["quarantine_file"], report)
        kinds_text = ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())) or "none"
        raise DFlashError(f"no prompts out of {counts['records']} records in {len(files)} files "
                          f"({len(quarantine)} quarantined, by kind {kinds_text}); the reasons are in "
                          f"{summary['quarantine_file']}", file=", ".join(inputs)).with_summary(summary)
    if rows:
        flush()
    storage.write_text(storage.join(output, QUARANTINE), report)
    manifest.commit(output, kind="prompts", files=shards, summary=summary, config=cfg.to_dict(), prefix="prompts-")
    return summary
