"""A generation's shards on storage: the work units cut from the prompt files, the plan that makes a
finished shard reusable, the progress file that lists the finished ones, their totals, and the
manifest that commits the output.

Restart: `_progress.json` (written by the pool, `generation.actors`) lists finished shards; a rerun
with the same prompts and shard size skips them, and a rerun of a finished job starts no actor at
all. The output is a dataset only once `_manifest.json` (written last, by `commit`) lists the winning
file of every shard. Ray-free: the driver reads and writes these before and after the pool runs.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Any

from dflash_ray import manifest, storage
from dflash_ray.config import GenerateConfig, RunConfig
from dflash_ray.errors import DFlashError
from dflash_ray.generation.leases import PROGRESS


def plan_units(files: list[str], shard_size: int) -> list[dict[str, Any]]:
    """Work units (file, first row, row count) over the prompt shards, in a fixed order."""
    from dflash_ray.arrow_files import open_parquet

    if shard_size < 1:
        raise DFlashError(f"must be >= 1, got {shard_size}", field="generate.shard_size")
    units: list[dict[str, Any]] = []
    for uri in files:
        fs, path = storage.arrow_filesystem(uri)
        with fs.open_input_file(path) as f:
            rows = open_parquet(f, uri).metadata.num_rows  # refused here, before any generator reads a row
        for start in range(0, rows, shard_size):
            units.append({"index": len(units), "uri": uri, "start": start, "count": min(shard_size, rows - start)})
    return units


def shard_plan(prompts_uri: str, units: list[dict[str, Any]], model: str, cfg: GenerateConfig) -> dict[str, str]:
    """What makes finished shards reusable, part by part: the prompts' content (not their path or file
    names: a pipeline rerun on new inputs rewrites the same file names), the units, model and sampling."""

    def digest(body: Any) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]

    return {
        "prompts": manifest.fingerprint(prompts_uri),
        "model": model,
        "shards": digest([(storage.basename(u["uri"]), u["start"], u["count"]) for u in units]),
        "sampling": digest(
            [
                cfg.temperature,
                cfg.top_p,
                cfg.max_tokens,
                cfg.seed,
                cfg.enable_thinking,
                cfg.chat_template_kwargs,
                cfg.backend,
                cfg.samples_per_prompt,
            ]
        ),
    }


PLAN_PARTS = {
    "prompts": "the prompts' content (--prompts was rewritten since)",
    "model": "the model",
    "shards": "the shard size (generate.shard_size)",
    "sampling": "the sampling settings (generate.temperature, top_p, max_tokens, seed, thinking, backend, "
    "samples_per_prompt)",
}


def read_progress(output: str) -> dict[str, Any] | None:
    """The progress file of the generation at `output`, checked (None: there is none yet): every
    finished shard as `totals` sums it and the files it names inside `output`."""
    uri = storage.join(output, PROGRESS)
    try:
        progress = json.loads(storage.read_text(uri))
    except FileNotFoundError:
        return None
    except ValueError as e:  # not JSON, cut short, or not UTF-8 text at all
        raise DFlashError(
            f"corrupt generation progress ({e}); delete it to generate every shard again", file=uri
        ) from None
    if not isinstance(progress, dict) or not isinstance(progress.get("done"), dict):
        raise DFlashError(
            "not a generation progress file (a mapping with `done` shards); delete it to generate every shard again",
            file=uri,
            field="done",
        )
    for index, entry in progress["done"].items():
        _check_shard(output, uri, index, entry)
    return progress


def _check_shard(output: str, uri: str, index: str, entry: Any) -> None:
    """One finished shard of a progress file: its index, the files it names (read, copied, deleted:
    they stay inside `output`) and the counts `totals` sums."""

    def refuse(what: str, field: str) -> DFlashError:
        return DFlashError(
            f"not a generation progress file: {what}; delete it to generate every shard again", file=uri, field=field
        )

    at = f"done.{index}"
    if not (index.isascii() and index.isdigit()):
        raise refuse(f"{index!r} is no shard index (a whole number >= 0)", "done")
    if not isinstance(entry, dict) or not {"completions", "rows", "prompts"} <= set(entry):
        raise refuse("a finished shard is a mapping with `completions`, `rows` and `prompts`", at)
    for key in ("completions", "rejected"):
        if key in entry:
            storage.inside(output, entry[key], file=uri, field=f"{at}.{key}")
    counts = entry.get("counts")
    if not isinstance(counts, dict) or "rejected" not in counts:
        raise refuse("a finished shard's `counts` is a mapping with `rejected`", f"{at}.counts")
    numbers = [(f"{at}.{k}", entry.get(k)) for k in ("prompts", "rows", "output_tokens")]
    for field, value in numbers + [(f"{at}.counts.{k}", v) for k, v in counts.items()]:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise refuse(f"{value!r} is not a count (a whole number >= 0)", field)
    if entry.get("node") is not None and not isinstance(entry["node"], str):
        raise refuse(f"{entry['node']!r} is no node address", f"{at}.node")


def finished_shards(output: str, plan: dict[str, str]) -> dict[int, dict[str, Any]]:
    """The shards a run before this one finished, by index; refused when they answer another plan."""
    progress = read_progress(output)
    if progress is None:
        return {}
    held = progress.get("plan")
    if held != plan:
        changed = [PLAN_PARTS[k] for k in plan if not isinstance(held, dict) or held.get(k) != plan[k]]
        raise DFlashError(
            f"holds a generation made with other inputs; changed: {'; '.join(changed)}. Its shards "
            "would not answer these prompts: choose another --output or delete this one",
            file=storage.join(output, PROGRESS),
        )
    done = {}
    for index, entry in progress["done"].items():  # a shard whose file is gone is generated again
        if storage.exists(storage.join(output, entry["completions"])):
            done[int(index)] = entry
    return done


def totals(done: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The summary's figures over the finished shards."""
    kinds: collections.Counter[str] = collections.Counter()
    for entry in done.values():
        kinds.update({k: v for k, v in entry["counts"].items() if k not in ("completions", "rejected")})
    return {
        "prompts": sum(e["prompts"] for e in done.values()),
        "completions": sum(e["rows"] for e in done.values()),
        "rejected": sum(e["counts"]["rejected"] for e in done.values()),
        "rejected_kinds": {
            k: v for k, v in sorted(kinds.items()) if k not in ("truncated_kept", "conversations_cut") and v
        },
        "truncated_kept": kinds.get("truncated_kept", 0),
        "conversations_cut": kinds.get("conversations_cut", 0),
        "output_tokens": sum(e["output_tokens"] for e in done.values()),
        "generator_nodes": sorted({e["node"] for e in done.values() if e.get("node")}),
    }


def commit(
    output: str, units: list[dict[str, Any]], done: dict[int, dict[str, Any]], summary: dict[str, Any], cfg: RunConfig
) -> None:
    """Write the manifest of the winning files (and the merged rejects); delete every other file."""
    missing = [u["index"] for u in units if u["index"] not in done]
    if missing:
        raise DFlashError(f"shards {missing[:10]} never finished", file=output)
    entries = [
        {
            "name": done[u["index"]]["completions"],
            "rows": done[u["index"]]["rows"],
            **{k: done[u["index"]][k] for k in ("bytes", "sha256") if k in done[u["index"]]},
        }
        for u in units
    ]
    keep = {e["name"] for e in entries} | {done[u["index"]]["rejected"] for u in units}
    rejected = "".join(storage.read_text(storage.join(output, done[u["index"]]["rejected"])) for u in units)
    storage.write_text(storage.join(output, manifest.REJECTED), rejected)
    for uri in storage.list_files(output, (".parquet", ".jsonl")):
        name = storage.basename(uri)
        if name.startswith(("completions-", "rejected-")) and name not in keep:
            storage.delete(uri)
    manifest.write_manifest(output, kind="completions", files=entries, summary=summary, config=cfg.to_dict())
