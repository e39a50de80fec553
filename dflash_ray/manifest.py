"""Dataset manifests: a stage's output folder is complete only once `_manifest.json` exists.

The manifest is written last and lists every data file with its row count and byte size, so a
reader uses exactly the files of one finished run: leftovers of a crashed run are never read, and a
truncated file is caught by its size before it is used.
"""

from __future__ import annotations

import json
import time
from typing import Any

from dflash_ray import storage
from dflash_ray.errors import DFlashError

MANIFEST = "_manifest.json"


def write_manifest(folder: str, *, kind: str, files: list[dict[str, Any]],
                   summary: dict[str, Any], config: dict[str, Any] | None = None) -> str:
    """Write the manifest of a finished dataset; `files` hold `name`, `rows` (and `bytes`)."""
    for entry in files:
        entry.setdefault("bytes", storage.size(storage.join(folder, entry["name"])))
    body = {"kind": kind, "created": time.time(), "files": files, "summary": summary,
            "config": config or {}}
    uri = storage.join(folder, MANIFEST)
    storage.write_text(uri, json.dumps(body, indent=1, sort_keys=True))
    return uri


def read_manifest(folder: str) -> dict[str, Any] | None:
    uri = storage.join(folder, MANIFEST)
    try:
        return json.loads(storage.read_text(uri))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as e:
        raise DFlashError(f"corrupt manifest: {e}", file=uri) from None


def dataset_files(uri: str, suffixes: tuple[str, ...] = (".parquet", ".jsonl")) -> list[str]:
    """The data files of a dataset at `uri`: one file, or a folder (its manifest when present).

    A folder without a manifest (user data, not written by this project) is read whole.
    """
    if storage.is_s3(uri) or not storage.local_path(uri).is_dir():
        if str(uri).endswith(suffixes) and storage.exists(uri):
            return [str(uri)]
    manifest = read_manifest(uri)
    if manifest is None:
        files = storage.list_files(uri, suffixes)
        if not files:
            raise DFlashError(f"no {'/'.join(suffixes)} files found", file=uri)
        return files
    files = []
    for entry in manifest["files"]:
        path = storage.join(uri, entry["name"])
        actual = storage.size(path) if storage.exists(path) else None
        if actual != entry["bytes"]:
            raise DFlashError(f"listed in the manifest with {entry['bytes']} bytes, found "
                              f"{actual if actual is not None else 'no file'}", file=path)
        files.append(path)
    return files


def read_rows(uri: str, columns: list[str], limit: int) -> list[dict[str, Any]]:
    """The first `limit` rows of a Parquet dataset, with only `columns` read."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path_uri in dataset_files(uri, (".parquet",)):
        fs, path = storage.arrow_filesystem(path_uri)
        rows += pq.read_table(path, filesystem=fs, columns=columns).to_pylist()
        if len(rows) >= limit:
            break
    return rows[:limit]
