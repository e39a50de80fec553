"""Dataset manifests: a stage's output folder is complete only once `_manifest.json` exists.

The manifest is written last and lists every data file with its row count and byte size, so a
reader uses exactly the files of one finished run: leftovers of a crashed run are never read, and a
truncated file is caught by its size before it is used. A rerun writes its files under new names
and replaces the manifest only once they are all written (`commit`), so a rerun that fails leaves
the previous dataset whole.
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
    except (FileNotFoundError, NotADirectoryError):  # no folder, or a file given as one
        return None
    except json.JSONDecodeError as e:
        raise DFlashError(f"corrupt manifest: {e}", file=uri) from None


def dataset_files(uri: str, suffixes: tuple[str, ...] = (".parquet", ".jsonl")) -> list[str]:
    """The data files of a dataset at `uri`: one file, or a folder (its manifest when present).

    A folder without a manifest (user data, not written by this project) is read whole.
    """
    if not storage.is_s3(uri) and not storage.local_path(uri).exists():
        raise DFlashError("no such file or folder", file=uri)
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


def listed_rows(uri: str) -> dict[str, int]:
    """Each data file's row count as its dataset's manifest promised it (empty: no manifest)."""
    found = read_manifest(uri) if not str(uri).endswith((".parquet", ".jsonl")) else None
    return {storage.join(uri, e["name"]): int(e["rows"]) for e in (found or {}).get("files", []) if "rows" in e}


def commit(folder: str, *, kind: str, files: list[dict[str, Any]], summary: dict[str, Any],
           config: dict[str, Any] | None, prefix: str) -> str:
    """Make a finished run the dataset: write its manifest (replacing an earlier run's in one
    atomic write), then delete the data files of earlier runs, named `{prefix}*` but not listed."""
    uri = write_manifest(folder, kind=kind, files=files, summary=summary, config=config)
    listed = {entry["name"] for entry in files}
    for stale in storage.list_files(folder, ".parquet"):
        name = storage.basename(stale)
        if name.startswith(prefix) and name not in listed:
            storage.delete(stale)
    return uri


def report_uri(folder: str, name: str) -> str:
    """Where a run that fails leaves its report (quarantine, rejects): `name`, unless a finished
    dataset is in `folder`, whose own report it must not replace; then `_failed-{name}`."""
    return storage.join(folder, name if read_manifest(folder) is None else f"_failed-{name}")


def read_rows(uri: str, columns: list[str] | None, limit: int) -> list[dict[str, Any]]:
    """The first `limit` rows of a Parquet dataset, with only `columns` read (None: all)."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path_uri in dataset_files(uri, (".parquet",)):
        fs, path = storage.arrow_filesystem(path_uri)
        rows += pq.read_table(path, filesystem=fs, columns=columns).to_pylist()
        if len(rows) >= limit:
            break
    return rows[:limit]
