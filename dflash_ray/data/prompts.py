"""`dflash-ray prompts`: raw chat datasets → normalized, deduplicated prompt shards.

Output folder: `prompts-NNNNN.parquet` (schema `PROMPTS`), `quarantine.jsonl` (one line per bad
record: file, line, kind, reason, raw record) and `_manifest.json`, written last. One bad record
never stops the run; every record ends up either in a shard, in quarantine, or counted as a
duplicate.
"""

from __future__ import annotations

import collections
import io
import json
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray import manifest, storage
from dflash_ray.config import RunConfig
from dflash_ray.data import schema
from dflash_ray.data.formats import BadRecord, Prompt, normalize
from dflash_ray.data.records import SUFFIXES, RawRecord, iter_records, raw_preview

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
    if manifest.read_manifest(output) is not None:  # a rerun: the old dataset stops being complete now
        storage.delete(storage.join(output, manifest.MANIFEST))

    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    shards: list[dict[str, Any]] = []
    quarantine: list[str] = []
    kinds: collections.Counter[str] = collections.Counter()
    counts = collections.Counter()

    def flush() -> None:
        name = f"prompts-{len(shards):05d}.parquet"
        storage.write_bytes(storage.join(output, name), shard_bytes(rows))
        shards.append({"name": name, "rows": len(rows)})
        rows.clear()

    def quarantined(item: RawRecord, error: BadRecord) -> None:
        kinds[error.kind] += 1
        quarantine.append(json.dumps({"file": item.file, "line": item.line, "kind": error.kind,
                                      "reason": str(error), "record": raw_preview(item)},
                                     ensure_ascii=False))

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
            for prompt in prompts:
                if prompt.id in seen:
                    counts["duplicates"] += 1
                    continue
                seen.add(prompt.id)
                rows.append(prompt.row(source))
                if len(rows) >= pcfg.shard_size:
                    flush()
    bar.close()
    if rows or not shards:
        flush()
    storage.write_text(storage.join(output, QUARANTINE), "".join(line + "\n" for line in quarantine))
    summary = {
        "stage": "prompts", "output": output, "input_files": len(files),
        "records": counts["records"], "prompts": len(seen), "duplicates": counts["duplicates"],
        "quarantined": len(quarantine), "quarantine_kinds": dict(sorted(kinds.items())),
        "quarantine_file": storage.join(output, QUARANTINE), "shards": len(shards),
    }
    manifest.write_manifest(output, kind="prompts", files=shards, summary=summary, config=cfg.to_dict())
    return summary
