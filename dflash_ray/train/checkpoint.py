"""Training checkpoints on `file://` or `s3://`: complete only once their manifest is written.

Layout: `OUTPUT/checkpoints/step-00000042/` holding named files (each drafter rank's shard of the
weights and optimizer state under `shards/`, see `checkpoint_files`; the serving config under `drafter/`; the
run state with data position and every RNG in `state.json`) and `MANIFEST.json`, written last, with
each file's size and sha256. A resume takes the newest checkpoint whose manifest exists and whose
files all match it; anything else is never used.

Checking costs differ: `verify` compares sizes only (one metadata request per file, nothing read),
what the coordinator can afford for a checkpoint of tens of GB; `read_file` checks the sha256 of
what it reads, so whoever loads a file (each drafter its weights and optimizer state) checks it.
Rotation deletes only checkpoints older than the newest one that verifies.

Writing a checkpoint of tens of GB to S3 takes minutes; its files are written from a thread on
every rank while training goes on (`Upload`, `checkpoint_files.save`), and the
manifest is committed once they are all written. A run that fails before then resumes from the
checkpoint before: an unfinished upload has no manifest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dflash_ray import storage
from dflash_ray.manifest import file_entry

MANIFEST = "MANIFEST.json"
log = logging.getLogger(__name__)


class CorruptCheckpoint(ValueError):
    """A checkpoint without a readable manifest, or whose files differ from it: never used."""


def step_dir(output: str, step: int) -> str:
    return storage.join(output, "checkpoints", f"step-{step:08d}")


def write_file(output: str, step: int, name: str, data: bytes) -> dict:
    """Write one file of a checkpoint atomically; returns its manifest entry. Several processes
    may write the files of one checkpoint (each drafter writes its own); one commits."""
    storage.write_bytes(storage.join(step_dir(output, step), name), data)
    return file_entry(data)


class Upload:
    """A checkpoint's files written by a background thread (`write()` writes them and returns their
    manifest entries), so the caller goes on at once; `result` gives the entries."""

    def __init__(self, write: Callable[[], dict[str, dict]], name: str = "checkpoint-upload"):
        self._entries: dict[str, dict] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(write,), daemon=True, name=name)
        self._thread.start()

    def _run(self, write: Callable[[], dict[str, dict]]) -> None:
        try:
            self._entries = write()
        except BaseException as e:  # raised again by `result`, in the caller's thread
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> dict[str, dict]:
        """The manifest entries, once every file is written (waits for it); the writer's error if one failed."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._entries is not None  # the writer finished without an error
        return self._entries


def begin(output: str, step: int) -> None:
    """Mark a checkpoint incomplete before its files are (re)written: a manifest left by an earlier
    run at this step must not vouch for files half replaced."""
    storage.delete(storage.join(step_dir(output, step), MANIFEST))


def commit(output: str, step: int, entries: dict[str, dict], meta: dict | None = None) -> str:
    """Write the manifest, last: the checkpoint exists from that moment."""
    folder = step_dir(output, step)
    manifest = {"step": step, "created": time.time(), "files": entries, "meta": meta or {}}
    storage.write_text(storage.join(folder, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
    return folder


def save(output: str, step: int, files: dict[str, bytes], meta: dict | None = None) -> str:
    """Write every file, then the manifest."""
    begin(output, step)
    entries = {name: write_file(output, step, name, data) for name, data in files.items()}
    return commit(output, step, entries, meta)


def step_of(folder: str) -> int | None:
    name = storage.basename(folder)
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def complete_steps(output: str) -> list[int]:
    """Steps whose manifest exists (files not yet verified), oldest first."""
    steps = []
    for folder in storage.list_dirs(storage.join(output, "checkpoints")):
        step = step_of(folder)
        if step is not None and storage.exists(storage.join(folder, MANIFEST)):
            steps.append(step)
    return sorted(steps)


def read_manifest(output: str, step: int) -> dict:
    """The manifest of a checkpoint (CorruptCheckpoint when it is missing or unreadable)."""
    return read_folder_manifest(step_dir(output, step))


def _entry(manifest: dict, folder: str, name: str) -> dict:
    if name not in manifest["files"]:
        raise CorruptCheckpoint(f"{storage.join(folder, name)}: not listed in the manifest")
    return manifest["files"][name]


def read_file(output: str, step: int, name: str, manifest: dict | None = None) -> bytes:
    """One file of a checkpoint, its size and sha256 checked against the manifest."""
    return read_checked(step_dir(output, step), name, manifest or read_manifest(output, step))


def _check(uri: str, entry: dict, size: int, sha256: Callable[[], str]) -> None:
    if size != entry["bytes"]:
        raise CorruptCheckpoint(f"{uri}: {size} bytes, the manifest lists {entry['bytes']} (truncated)")
    if sha256() != entry["sha256"]:
        raise CorruptCheckpoint(f"{uri}: its sha256 does not match the manifest's checksum (corrupt)")


def read_checked(folder: str, name: str, manifest: dict) -> bytes:
    """One file of the checkpoint in `folder`, its size and sha256 checked against `manifest`."""
    entry, uri = _entry(manifest, folder, name), storage.join(folder, name)
    try:
        data = storage.read_bytes(uri)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{uri}: listed in the manifest but missing") from None
    _check(uri, entry, len(data), lambda: hashlib.sha256(data).hexdigest())
    return data


def check_out(folder: str, name: str, manifest: dict, dest: Path | None) -> None:
    """Check one (possibly large) file of the checkpoint in `folder` against `manifest`, reading it in
    chunks; with `dest`, first fetch it there (a checkpoint on S3)."""
    entry, uri = _entry(manifest, folder, name), storage.join(folder, name)
    try:
        if dest is not None:
            dest.write_bytes(storage.read_bytes(uri))
        path = dest or storage.local_path(uri)
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{uri}: listed in the manifest but missing") from None
    _check(uri, entry, size, lambda: storage.sha256(str(path)))


def copy_in(path: Path, folder: str, name: str) -> dict:
    """Copy a local file into the checkpoint in `folder` as `name` (atomically); its manifest entry."""
    uri = storage.join(folder, name)
    if storage.is_s3(uri):
        storage.upload_file(path, uri)
    else:
        target = storage.local_path(uri)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.copyfile(path, tmp)
        os.replace(tmp, target)
    return {"bytes": path.stat().st_size, "sha256": storage.sha256(str(path))}


def read_folder_manifest(folder: str) -> dict:
    """The manifest of the checkpoint in `folder`, whatever the folder is called (a copied or renamed
    checkpoint too); CorruptCheckpoint when it is missing or unreadable, or lists a file outside the folder."""
    uri = storage.join(folder, MANIFEST)
    try:
        manifest = json.loads(storage.read_text(uri))
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise ValueError("no file list")
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{uri}: no manifest") from None
    except ValueError as e:
        raise CorruptCheckpoint(f"{uri}: unreadable manifest: {e}") from None
    for name in manifest["files"]:  # what it lists is read and checked: nothing outside the checkpoint
        reason = storage.escapes(folder, name)
        if reason is not None:
            raise CorruptCheckpoint(f"{uri}: lists {name!r}, which {reason}: nothing outside the checkpoint is read")
    return manifest


def verify(output: str, step: int) -> dict:
    """The manifest of a checkpoint whose files all exist at the sizes it lists (nothing is read;
    `read_file` checks the checksums). CorruptCheckpoint otherwise."""
    manifest = read_manifest(output, step)
    folder = step_dir(output, step)
    for name, entry in manifest["files"].items():
        uri = storage.join(folder, name)
        try:
            actual = storage.size(uri)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{uri}: listed in the manifest but missing") from None
        if actual != entry["bytes"]:
            raise CorruptCheckpoint(f"{uri}: {actual} bytes, the manifest lists {entry['bytes']} (truncated)")
    return manifest


def load(output: str, step: int) -> tuple[dict[str, bytes], dict]:
    """Every file of a checkpoint, verified against its manifest (CorruptCheckpoint when they differ)."""
    manifest = read_manifest(output, step)
    files = {name: read_file(output, step, name, manifest) for name in manifest["files"]}
    return files, manifest.get("meta", {})


def rotate(output: str, keep: int, upto: int | None = None) -> list[int]:
    """Keep the newest `keep` checkpoints that verify; delete every other checkpoint or leftover
    folder OLDER than the newest one that verifies. Nothing newer is touched (an unverified newer
    checkpoint is never what a resume takes, and deleting it could lose the only copy of a step), and
    with `upto` (the step just written) neither is anything after it. Returns the deleted steps."""
    folders = [s for s in (step_of(f) for f in storage.list_dirs(storage.join(output, "checkpoints"))) if s is not None]
    kept: list[int] = []
    for step in reversed(complete_steps(output)):
        if upto is not None and step > upto:
            continue
        try:
            verify(output, step)
        except CorruptCheckpoint as e:
            log.warning("checkpoint step %d does not verify: %s", step, e)
            continue
        kept.append(step)
        if len(kept) >= max(keep, 1):
            break
    if not kept:
        return []
    deleted = sorted(s for s in folders if s < kept[0] and s not in kept)
    for step in deleted:
        storage.delete_tree(step_dir(output, step))
    return deleted
