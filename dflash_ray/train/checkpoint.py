"""Training checkpoints on `file://` or `s3://`: complete only once their manifest is written.

Layout: `OUTPUT/checkpoints/step-00000042/` holding named files (the drafter in the serving
format under `drafter/`, optimizer and scheduler state, the run state with data position and every
RNG) and `MANIFEST.json`, written last, with each file's size and sha256. A resume takes the newest
checkpoint whose manifest exists and whose files all match it; anything else is never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

from dflash_ray import storage

MANIFEST = "MANIFEST.json"
log = logging.getLogger(__name__)


def step_dir(output: str, step: int) -> str:
    return storage.join(output, "checkpoints", f"step-{step:08d}")


def write_file(output: str, step: int, name: str, data: bytes) -> dict:
    """Write one file of a checkpoint atomically; returns its manifest entry. Several processes
    may write the files of one checkpoint (each drafter writes its own); one commits."""
    storage.write_bytes(storage.join(step_dir(output, step), name), data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def commit(output: str, step: int, entries: dict[str, dict], meta: dict | None = None) -> str:
    """Write the manifest, last: the checkpoint exists from that moment."""
    folder = step_dir(output, step)
    manifest = {"step": step, "created": time.time(), "files": entries, "meta": meta or {}}
    storage.write_text(storage.join(folder, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True))
    return folder


def save(output: str, step: int, files: dict[str, bytes], meta: dict | None = None) -> str:
    """Write every file, then the manifest."""
    storage.delete(storage.join(step_dir(output, step), MANIFEST))  # incomplete until committed again
    entries = {name: write_file(output, step, name, data) for name, data in files.items()}
    return commit(output, step, entries, meta)


def _step_of(folder: str) -> int | None:
    name = storage.basename(folder)
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def complete_steps(output: str) -> list[int]:
    """Steps whose manifest exists (files not yet verified), oldest first."""
    steps = []
    for folder in storage.list_dirs(storage.join(output, "checkpoints")):
        step = _step_of(folder)
        if step is not None and storage.exists(storage.join(folder, MANIFEST)):
            steps.append(step)
    return sorted(steps)


def load(output: str, step: int) -> tuple[dict[str, bytes], dict]:
    """The files of a checkpoint, verified against its manifest (ValueError when they differ)."""
    folder = step_dir(output, step)
    manifest = json.loads(storage.read_text(storage.join(folder, MANIFEST)))
    files = {}
    for name, entry in manifest["files"].items():
        uri = storage.join(folder, name)
        try:
            data = storage.read_bytes(uri)
        except FileNotFoundError:
            raise ValueError(f"{uri}: listed in the manifest but missing") from None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"{uri}: {len(data)} bytes do not match the manifest's {entry['bytes']} "
                             "bytes and checksum")
        files[name] = data
    return files, manifest.get("meta", {})


def load_latest(output: str) -> tuple[int, dict[str, bytes], dict] | None:
    """The newest checkpoint that verifies; broken ones are skipped with a warning."""
    for step in reversed(complete_steps(output)):
        try:
            files, meta = load(output, step)
            return step, files, meta
        except ValueError as e:
            log.warning("skipping checkpoint step %d: %s", step, e)
    return None


def rotate(output: str, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete checkpoints, and any incomplete one older than
    the newest complete one. Returns the deleted steps."""
    steps = complete_steps(output)
    if not steps:
        return []
    deleted = steps[:-keep] if keep > 0 else []
    newest = steps[-1]
    for folder in storage.list_dirs(storage.join(output, "checkpoints")):
        step = _step_of(folder)
        if step is not None and step < newest and step not in steps:
            deleted.append(step)
    for step in deleted:
        storage.delete_tree(step_dir(output, step))
    return sorted(deleted)
