"""`dflash-ray tokenize`: completion shards → tokenized Parquet shards, with Ray Data.

A class UDF loads the tokenizer once per worker; Ray Data streams the rows through it, shows its
progress bars and writes Parquet files named for this run. The run's `_manifest.json`, written
last, lists exactly those files, so a crashed run's leftovers are never read and a reader never sees
a half-written dataset. Rejected rows (over-long under `drop`, missing fields, template errors) are
collected with their reason by a small ledger actor and written to `rejected.jsonl`.
"""

from __future__ import annotations

import collections
import json
import uuid
from typing import Any

import numpy as np
import pyarrow as pa

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


class _Ledger:
    """Collects rejected rows by id, so a retried batch is not counted twice."""

    def __init__(self):
        self.rejects: dict[str, dict[str, str]] = {}

    def add(self, rejects: list[dict[str, str]]) -> None:
        for r in rejects:
            self.rejects[r["id"]] = r

    def items(self) -> list[dict[str, str]]:
        return list(self.rejects.values())


class _TokenizeUDF:
    """Ray Data shell over `TokenizeBatch`."""

    def __init__(self, cfg: TokenizeConfig, ledger):
        self.tokenize = TokenizeBatch(cfg)
        self.ledger = ledger

    def __call__(self, batch: pa.Table) -> pa.Table:
        import ray

        columns, rejects = self.tokenize(batch.to_pylist())
        if rejects:
            ray.get(self.ledger.add.remote(rejects))
        return to_table(columns)


def _read(files: list[str]):
    import ray.data

    fs, _ = storage.arrow_filesystem(files[0])
    paths = [storage.arrow_filesystem(f)[1] for f in files]
    if all(f.endswith(".parquet") for f in files):
        return ray.data.read_parquet(paths, filesystem=fs)
    if all(f.endswith(".jsonl") for f in files):
        return ray.data.read_json(paths, filesystem=fs)  # newline-delimited JSON
    raise DFlashError("mixes Parquet and JSONL files; give one format", file=files[0])


def _count_rows(files: list[str]) -> int:
    import pyarrow.parquet as pq

    total = 0
    for uri in files:
        fs, path = storage.arrow_filesystem(uri)
        with fs.open_input_file(path) as f:
            total += pq.ParquetFile(f).metadata.num_rows
    return total


def run_tokenize(input_uri: str, output: str, cfg: RunConfig) -> dict[str, Any]:
    import ray
    import ray.data
    import pyarrow.parquet as pq
    from ray.data.datasource import FilenameProvider

    tcfg = cfg.tokenize
    files = manifest.dataset_files(input_uri, (".parquet", ".jsonl"))
    connect(cfg.ray)
    old = manifest.read_manifest(output)
    if old is not None:  # a rerun: the old dataset stops being complete now
        storage.delete(storage.join(output, manifest.MANIFEST))

    ledger = ray.remote(num_cpus=0)(_Ledger).remote()
    ds = _read(files)
    num_rows_in = _count_rows(files) if files[0].endswith(".parquet") else ds.count()
    workers = tcfg.concurrency or max(1, int(ray.cluster_resources().get("CPU", 1)))
    # An autoscaling pool: a fixed pool holding every CPU from the start starves the read tasks.
    ds = ds.map_batches(_TokenizeUDF, fn_constructor_kwargs={"cfg": tcfg, "ledger": ledger},
                        batch_size=tcfg.batch_size, batch_format="pyarrow", num_cpus=1,
                        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=workers))

    run_id = uuid.uuid4().hex[:12]
    prefix = f"tokenized-{run_id}"
    fs, path = storage.arrow_filesystem(output)
    ds.write_parquet(path, filesystem=fs, max_rows_per_file=tcfg.rows_per_file,
                     filename_provider=FilenameProvider(dataset_uuid=prefix, file_format="parquet"))

    written = [f for f in storage.list_files(output, ".parquet") if storage.basename(f).startswith(prefix)]
    entries, num_tokens, num_truncated = [], 0, 0
    for uri in written:
        afs, apath = storage.arrow_filesystem(uri)
        table = pq.read_table(apath, filesystem=afs, columns=["seq_len", "truncated"])
        entries.append({"name": storage.basename(uri), "rows": table.num_rows})
        num_tokens += int(pa.compute.sum(table["seq_len"]).as_py() or 0)
        num_truncated += int(pa.compute.sum(table["truncated"].cast(pa.int64())).as_py() or 0)
    rejects = ray.get(ledger.items.remote())
    ray.kill(ledger)
    storage.write_text(storage.join(output, REJECTED),
                       "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))
    num_rows_out = sum(e["rows"] for e in entries)
    summary = {
        "stage": "tokenize", "output": output, "tokenizer": tcfg.tokenizer,
        "rows_in": num_rows_in, "rows_out": num_rows_out, "rejected": len(rejects),
        "rejected_kinds": dict(collections.Counter(r["kind"] for r in rejects)),
        "truncated": num_truncated, "tokens": num_tokens, "files": len(entries),
    }
    if num_rows_in != num_rows_out + len(rejects):
        raise DFlashError(f"{num_rows_in} rows in, {num_rows_out} written and {len(rejects)} "
                          "rejected: rows were lost (duplicate ids in the input?)", file=input_uri)
    manifest.write_manifest(output, kind="tokenized", files=entries, summary=summary, config=cfg.to_dict())
    for stale in storage.list_files(output, ".parquet"):  # files of earlier runs, no longer listed
        if not storage.basename(stale).startswith(prefix):
            storage.delete(stale)
    return summary
