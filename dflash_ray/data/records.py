"""Read records one at a time from JSONL, JSON-array and Parquet files, local or on S3.

A record that cannot be decoded (invalid UTF-8, malformed JSON) comes back with its error instead
of stopping the read, so the caller can quarantine it with its file and line.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Iterator

from dflash_ray import storage
from dflash_ray.data.formats import BadRecord

SUFFIXES = (".jsonl", ".json", ".parquet")
RAW_PREVIEW = 2000  # characters of a bad record kept in quarantine


@dataclass(slots=True)
class RawRecord:
    file: str
    line: int  # 1-based line (JSONL), element (JSON array) or row (Parquet)
    record: Any = None
    error: BadRecord | None = None
    raw: str = ""


def iter_records(uri: str) -> Iterator[RawRecord]:
    if uri.endswith(".parquet"):
        yield from _parquet(uri)
        return
    data = storage.read_bytes(uri)
    if uri.endswith(".json"):
        yield from _json_array(uri, data)
        return
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield RawRecord(uri, number, error=BadRecord(f"invalid UTF-8 at byte {e.start}", "invalid_utf8"),
                            raw=line[:RAW_PREVIEW].decode("utf-8", "replace"))
            continue
        try:
            yield RawRecord(uri, number, record=json.loads(text), raw=text)
        except json.JSONDecodeError as e:
            yield RawRecord(uri, number, error=BadRecord(f"malformed JSON: {e.msg} at column {e.colno}",
                                                         "malformed_json"), raw=text[:RAW_PREVIEW])


def _json_array(uri: str, data: bytes) -> Iterator[RawRecord]:
    try:
        items = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        yield RawRecord(uri, 1, error=BadRecord(f"unreadable JSON file: {e}", "malformed_json"))
        return
    if not isinstance(items, list):
        yield RawRecord(uri, 1, error=BadRecord("a .json file must hold a list of records", "unknown_schema"))
        return
    for number, item in enumerate(items, start=1):
        yield RawRecord(uri, number, record=item)


def _parquet(uri: str) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    number = 0
    table_file = pq.ParquetFile(io.BytesIO(storage.read_bytes(uri)))
    for batch in table_file.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            number += 1
            yield RawRecord(uri, number, record=row)


def raw_preview(item: RawRecord) -> str:
    if item.raw:
        return item.raw[:RAW_PREVIEW]
    try:
        return json.dumps(item.record, ensure_ascii=False, default=str)[:RAW_PREVIEW]
    except (TypeError, ValueError):
        return repr(item.record)[:RAW_PREVIEW]
