"""`dflash-ray tokenize`: completion shards → tokenized Parquet shards, with Ray Data.

The driver lists the work units (one per Parquet row group of the input) and Ray Data runs them
through a pool of actors, one per CPU, each loading the tokenizer once. An actor reads its unit,
tokenizes it, writes one output file atomically under a name fixed by the unit (a retried unit
rewrites the same file) and returns only a small summary row: rows, tokens, rejects. The tokens
never travel through the object store, and no write task competes with the actors for CPUs.
The `_manifest.json`, written last from those rows, lists exactly this run's files, so a crashed
run's leftovers are never read. Rejected rows (over-long under `drop`, missing fields, template
errors) go to `rejected.jsonl` with their reason.
"""

from __future__ import annotations

import collections
import io
import json
import uuid
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_ray import manifest, storage
from dflash_ray.cluster import connect
from dflash_ray.config import RunConfig, TokenizeConfig
from dflash_ray.data import schema
from dflash_ray.data.masking import TokenizeBatch
from dflash_ray.errors import DFlashError

REJECTED = "rejected.jsonl"


def _list_column(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def to_table(columns: dict[str, list]) -> pa.Table:
    return pa.Table.from_arrays([
        pa.array(columns["id"], pa.string()),
        pa.array(columns["source"], pa.string()),
        _list_column(columns["input_ids"], pa.int32()),
        _list_column(columns["loss_mask"], pa.int8()),
        pa.array(columns["seq_len"], pa.int32()),
        pa.array(columns["truncated"], pa.bool_()),
    ], schema=schema.TOKENIZED)


class _TokenizeUnit:
    """Ray Data actor over `TokenizeBatch`: one input row = one work unit = one output file."""

    def __init__(self, cfg: TokenizeConfig, output: str, prefix: str):
        self.tokenize = TokenizeBatch(cfg)
        self.batch_size = cfg.batch_size
        self.output, self.prefix = output, prefix

    def __call__(self, unit: dict[str, Any]) -> dict[str, Any]:
        tables, rejects = [], []
        for rows in _unit_rows(unit["uri"], int(unit["row_group"]), self.batch_size):
            columns, batch_rejects = self.tokenize(rows)
            tables.append(to_table(columns))
            rejects += batch_rejects
        table = pa.concat_tables(tables) if tables else schema.TOKENIZED.empty_table()
        name = f"{self.prefix}-{int(unit['index']):06d}.parquet"
        sink = io.BytesIO()
        pq.write_table(table, sink)
        storage.write_bytes(storage.join(self.output, name), sink.getvalue())
        seq_len = table["seq_len"].to_numpy()
        return {"name": name, "rows": table.num_rows, "tokens": int(seq_len.sum()),
                "truncated": int(table["truncated"].to_numpy(zero_copy_only=False).sum()),
                "rejects": json.dumps(rejects)}


def _unit_rows(uri: str, row_group: int, batch_size: int) -> Iterator[list[dict[str, Any]]]:
    if uri.endswith(".jsonl"):
        lines = [json.loads(x) for x in storage.read_text(uri).splitlines() if x.strip()]
        for start in range(0, len(lines), batch_size):
            yield lines[start:start + batch_size]
        return
    fs, path = storage.arrow_filesystem(uri)
    with fs.open_input_file(path) as f:
        table = pq.ParquetFile(f).read_row_group(row_group)
    for batch in table.to_batches(max_chunksize=batch_size):
        yield batch.to_pylist()


def work_units(files: list[str]) -> tuple[list[dict[str, Any]], int]:
    """One unit per Parquet row group (per JSONL file), and the number of input rows.

    The driver hands Ray Data this explicit list rather than using a Ray Data reader: the reader's
    file-listing task would wait for a CPU that the tokenizer actors hold.
    """
    units, rows = [], 0
    for uri in files:
        if uri.endswith(".jsonl"):
            units.append({"index": len(units), "uri": uri, "row_group": 0})
            rows += sum(1 for x in storage.read_text(uri).splitlines() if x.strip())
        elif uri.endswith(".parquet"):
            fs, path = storage.arrow_filesystem(uri)
            with fs.open_input_file(path) as f:
                meta = pq.ParquetFile(f).metadata
            units += [{"index": len(units) + g, "uri": uri, "row_group": g} for g in range(meta.num_row_groups)]
            rows += meta.num_rows
        else:
            raise DFlashError("completions must be .parquet or .jsonl files", file=uri)
    return units, rows


def run_tokenize(input_uri: str, output: str, cfg: RunConfig) -> dict[str, Any]:
    import ray
    import ray.data

    tcfg = cfg.tokenize
    files = manifest.dataset_files(input_uri, (".parquet", ".jsonl"))
    units, num_rows_in = work_units(files)
    connect(cfg.ray)
    if manifest.read_manifest(output) is not None:  # a rerun: the old dataset stops being complete now
        storage.delete(storage.join(output, manifest.MANIFEST))

    prefix = f"tokenized-{uuid.uuid4().hex[:12]}"
    workers = min(len(units), tcfg.concurrency or max(1, int(ray.cluster_resources().get("CPU", 1))))
    ds = ray.data.from_items(units, override_num_blocks=len(units)).map(
        _TokenizeUnit, fn_constructor_kwargs={"cfg": tcfg, "output": output, "prefix": prefix},
        num_cpus=1, compute=ray.data.ActorPoolStrategy(size=workers))
    results = sorted(ds.take_all(), key=lambda r: r["name"])

    rejects = [r for res in results for r in json.loads(res["rejects"])]
    storage.write_text(storage.join(output, REJECTED),
                       "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))
    entries = [{"name": r["name"], "rows": int(r["rows"])} for r in results]
    num_rows_out = sum(e["rows"] for e in entries)
    summary = {
        "stage": "tokenize", "output": output, "tokenizer": tcfg.tokenizer,
        "rows_in": num_rows_in, "rows_out": num_rows_out, "rejected": len(rejects),
        "rejected_kinds": dict(collections.Counter(r["kind"] for r in rejects)),
        "truncated": sum(int(r["truncated"]) for r in results),
        "tokens": sum(int(r["tokens"]) for r in results), "files": len(entries),
    }
    if num_rows_in != num_rows_out + len(rejects):
        raise DFlashError(f"{num_rows_in} rows in, {num_rows_out} written and {len(rejects)} "
                          "rejected: rows were lost", file=input_uri)
    manifest.write_manifest(output, kind="tokenized", files=entries, summary=summary, config=cfg.to_dict())
    for stale in storage.list_files(output, ".parquet"):  # files of earlier runs, no longer listed
        if not storage.basename(stale).startswith(prefix):
            storage.delete(stale)
    return summary
