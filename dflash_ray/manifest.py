"""Dataset manifests: a stage's output folder is complete only once `_manifest.json` exists.

The manifest is written last and lists every data file with its row count, byte size and sha256,
so a reader uses exactly the files of one finished run: leftovers of a crashed run are never read,
and a truncated or altered file is refused by name before any work is spent on it (every stage
reads its input through `dataset_files` or `read_rows`, which check both). A rerun writes its files under new names
and replaces the manifest only once they are all written (`commit`), so a rerun that fails leaves
the previous dataset whole.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dflash_ray import storage
from dflash_ray.errors import DFlashError

MANIFEST = "_manifest.json"
# the command that writes each kind of dataset: what to rerun when one of its files is damaged
WRITTEN_BY = {
    "prompts": "prompts",
    "prompts-jsonl": "selfprompt",
    "completions": "generate (or responses)",
    "tokenized": "tokenize",
}


def file_entry(data: bytes) -> dict[str, Any]:
    """A file's manifest entry from the bytes written: its size and sha256."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _hash_all(uris: list[str]) -> list[str]:
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(uris)))) as pool:  # S3 reads overlap
        return list(pool.map(storage.sha256, uris))


def write_manifest(
    folder: str,
    *,
    kind: str,
    files: list[dict[str, Any]],
    summary: dict[str, Any],
    config: dict[str, Any] | None = None,
    made_from: dict[str, Any] | None = None,
) -> str:
    """Write the manifest of a finished dataset; `files` hold `name`, `rows` (and `bytes`, `sha256`
    when the writer has them: `file_entry`; otherwise the files are read back for them). `made_from`:
    the inputs and settings it was made from, which a later run into the folder is held to."""
    for entry in files:
        entry.setdefault("bytes", storage.size(storage.join(folder, entry["name"])))
    unhashed = [entry for entry in files if "sha256" not in entry]
    for entry, digest in zip(unhashed, _hash_all([storage.join(folder, e["name"]) for e in unhashed])):
        entry["sha256"] = digest
    body = {"kind": kind, "created": time.time(), "files": files, "summary": summary, "config": config or {}}
    if made_from is not None:
        body["made_from"] = made_from
    uri = storage.join(folder, MANIFEST)
    storage.write_text(uri, json.dumps(body, indent=1, sort_keys=True))
    return uri


def read_manifest(folder: str) -> dict[str, Any] | None:
    """The manifest of the dataset in `folder` (None: none there), every file it lists inside the
    folder (`storage.inside`: an entry naming a path outside is refused, nothing read)."""
    uri = storage.join(folder, MANIFEST)
    try:
        found = json.loads(storage.read_text(uri))
    except (FileNotFoundError, NotADirectoryError):  # no folder, or a file given as one
        return None
    except json.JSONDecodeError as e:
        raise DFlashError(f"corrupt manifest: {e}", file=uri) from None
    for i, entry in enumerate(found.get("files", []) if isinstance(found, dict) else []):
        storage.inside(
            folder, entry.get("name") if isinstance(entry, dict) else None, file=uri, field=f"files[{i}].name"
        )
    return found


def fingerprint(uri: str) -> str:
    """What a dataset holds, in a few hex digits: its manifest's files with their checksums, or for
    a folder without one (the user's own) each file's name and size. Same path, new data: a new print."""
    folder = (
        storage.is_s3(uri)
        and not str(uri).endswith((".parquet", ".arrow"))
        or not storage.is_s3(uri)
        and storage.local_path(uri).is_dir()
    )
    found = read_manifest(uri) if folder else None
    items: list[tuple[Any, ...]]
    if found is not None:
        items = sorted((e["name"], e.get("bytes"), e.get("sha256")) for e in found.get("files", []))
    else:
        items = sorted((storage.basename(f), storage.size(f)) for f in (storage.list_files(uri) if folder else [uri]))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _damaged(path: str, kind: Any, what: str) -> DFlashError:
    rerun = WRITTEN_BY.get(str(kind), "the stage that wrote it")
    return DFlashError(
        f"{what}: the file changed after the run that wrote this {kind} dataset (corrupt, "
        f"truncated or replaced); nothing was read. Rerun `dflash-ray {rerun}` into a new "
        f"output, or restore the file",
        file=path,
    )


def check(path: str, data: bytes, entry: dict[str, Any] | None, kind: Any = None) -> bytes:
    """`data`, read from `path`, if it is what the manifest's `entry` lists (None: nothing listed)."""
    if entry is not None and len(data) != entry["bytes"]:
        raise _damaged(path, kind, f"{len(data)} bytes, the manifest lists {entry['bytes']}")
    if entry is not None and "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise _damaged(path, kind, "its sha256 does not match the manifest's")
    return data


QUARANTINE = "quarantine.jsonl"  # the prompts' report: records that made no prompt, with file, line and reason
REJECTED = "rejected.jsonl"  # generation's and tokenization's: answers and rows left out, with the reason
RUN_REPORTS = (QUARANTINE, REJECTED)


def dataset_files(uri: str, suffixes: tuple[str, ...] = (".parquet", ".jsonl"), *, verify: bool = True) -> list[str]:
    """The data files of a dataset at `uri`: one file, or a folder (its manifest when present).

    A folder without a manifest (user data, not written by this project) is read whole. With a
    manifest every listed file must exist at its size and, with `verify`, hash to its sha256
    (datasets written before manifests held checksums are checked by size alone).
    """
    if not storage.is_s3(uri) and not storage.local_path(uri).exists():
        raise DFlashError("no such file or folder", file=uri)
    if storage.is_s3(uri) or not storage.local_path(uri).is_dir():
        if str(uri).lower().endswith(tuple(s.lower() for s in suffixes)) and storage.exists(uri):
            return [str(uri)]
    manifest = read_manifest(uri)
    if manifest is None:
        return _unlisted_files(uri, suffixes)
    return _listed_files(uri, manifest, verify)


SPLIT_DICT = "dataset_dict.json"  # what `DatasetDict.save_to_disk` writes above its splits' folders


def refuse_split_dict(uri: str) -> None:
    """A saved `DatasetDict` is a folder of splits: the error names them and the folder to give."""
    import json

    if not storage.exists(storage.join(uri, SPLIT_DICT)):
        return
    try:
        splits = [str(s) for s in json.loads(storage.read_text(storage.join(uri, SPLIT_DICT))).get("splits", [])]
    except (ValueError, AttributeError):
        splits = []
    raise DFlashError(
        f"a dataset with splits {', '.join(splits) or '(unnamed)'}: give one split's folder, e.g. "
        f"{storage.join(uri, splits[0] if splits else 'train')}",
        file=uri,
    )


def _unlisted_files(uri: str, suffixes: tuple[str, ...]) -> list[str]:
    """A folder without a manifest, read whole: unless it holds what a failed run of this project
    leaves (a report is not data), or nothing to read."""
    refuse_split_dict(uri)
    files = storage.list_files(uri, suffixes)
    report = next((f for f in files if storage.basename(f) in RUN_REPORTS), None)
    if report is not None:  # what a stage of this project leaves when it ends without its dataset
        raise DFlashError(
            f"holds {storage.basename(report)} but no {MANIFEST}: a run that did not finish, whose "
            "report is not data; rerun the stage that writes this folder (its error says why it stopped)",
            file=uri,
        )
    if not files:
        skipped = [storage.basename(f) for f in storage.skipped_files(uri)]
        also = f" (skipped: {', '.join(skipped[:10])})" if skipped else ""
        raise DFlashError(f"no {'/'.join(suffixes)} files found{also}", file=uri)
    return files


def _listed_files(uri: str, manifest: dict[str, Any], verify: bool) -> list[str]:
    """Every file the manifest lists, present at its size and, with `verify`, hashing to its sha256
    (hashed together, their reads overlapping, once every file is found at its size)."""
    files, hashed = [], []
    for entry in manifest["files"]:
        path = storage.join(uri, entry["name"])
        actual = storage.size(path) if storage.exists(path) else None
        if actual is None:
            raise _damaged(path, manifest.get("kind"), "listed in the manifest, missing")
        if actual != entry["bytes"]:
            raise _damaged(path, manifest.get("kind"), f"{actual} bytes, the manifest lists {entry['bytes']}")
        files.append(path)
        if verify and "sha256" in entry:
            hashed.append((path, entry["sha256"]))
    for (path, expected), found in zip(hashed, _hash_all([p for p, _ in hashed])):
        if found != expected:
            raise _damaged(path, manifest.get("kind"), "its sha256 does not match the manifest's")
    return files


def listed_rows(uri: str) -> dict[str, int]:
    """Each data file's row count as its dataset's manifest promised it (empty: no manifest)."""
    found = read_manifest(uri) if not str(uri).endswith((".parquet", ".jsonl")) else None
    return {storage.join(uri, e["name"]): int(e["rows"]) for e in (found or {}).get("files", []) if "rows" in e}


def commit(
    folder: str,
    *,
    kind: str,
    files: list[dict[str, Any]],
    summary: dict[str, Any],
    config: dict[str, Any] | None,
    prefix: str,
    made_from: dict[str, Any] | None = None,
) -> str:
    """Make a finished run the dataset: write its manifest (replacing an earlier run's in one
    atomic write), then delete the data files of earlier runs, named as a run names them
    (`{prefix}{run id}-{number}.parquet`) but not listed: nothing named otherwise is touched."""
    import re

    uri = write_manifest(folder, kind=kind, files=files, summary=summary, config=config, made_from=made_from)
    listed = {entry["name"] for entry in files}
    ours = re.compile(re.escape(prefix) + r"[0-9a-f]{8,}-[0-9]+\.parquet")
    for stale in storage.list_files(folder, ".parquet"):
        name = storage.basename(stale)
        if ours.fullmatch(name) and name not in listed:
            storage.delete(stale)
    return uri


def report_uri(folder: str, name: str) -> str:
    """Where a run that fails leaves its report (quarantine, rejects): `name`, unless a finished
    dataset is in `folder`, whose own report it must not replace; then `_failed-{name}`."""
    return storage.join(folder, name if read_manifest(folder) is None else f"_failed-{name}")


def require_columns(uri: str, columns: list[str], what: str) -> None:
    """Refuse, before any work, a dataset whose first file lacks `columns` (only its schema is read),
    naming the file, what it holds and what `what` (the flag or setting that named it) expects."""
    import pyarrow.parquet as pq

    from dflash_ray.arrow_files import checked

    first = dataset_files(uri, (".parquet",), verify=False)[0]
    fs, path = storage.arrow_filesystem(first)
    names = checked(pq.read_schema(path, filesystem=fs), first).names
    missing = [c for c in columns if c not in names]
    if missing:
        kind = (read_manifest(uri) or {}).get("kind") if not str(uri).endswith(".parquet") else None
        held = f"a {kind} dataset" if kind else f"columns {names}"
        raise DFlashError(
            f"{what} expects the column(s) {missing}, which this file lacks (it holds {held}): nothing was run",
            file=first,
        )


def read_rows(uri: str, columns: list[str] | None, limit: int) -> list[dict[str, Any]]:
    """The first `limit` rows of a Parquet dataset, with only `columns` read (None: all); each file
    read is checked against its manifest entry, and the files past `limit` are not read."""
    import pyarrow as pa

    from dflash_ray.arrow_files import read_parquet

    found = read_manifest(uri) if not str(uri).endswith(".parquet") else None
    listed = {storage.join(uri, e["name"]): e for e in (found or {}).get("files", [])}
    rows: list[dict[str, Any]] = []
    for path_uri in dataset_files(uri, (".parquet",), verify=False):
        data = check(path_uri, storage.read_bytes(path_uri), listed.get(path_uri), (found or {}).get("kind"))
        rows += read_parquet(pa.BufferReader(data), path_uri, columns=columns).to_pylist()
        if len(rows) >= limit:
            break
    return rows[:limit]
