"""One writer per output folder, and only of the output's own kind.

A stage that writes a dataset first claims its folder (`claim`): it refuses a folder whose
manifest holds another kind of dataset (prompts pointed at a tokenized folder would orphan its
shards), and one another live run is writing (two runs into one folder would each report ok while
one's records are lost). The claim is a small `_writer.json` (owner, host, pid, heartbeat) that a
thread renews while the stage runs, on local disk and S3 alike. A claim whose heartbeat is older
than `TIMEOUT_S`, or whose process on this host is gone (a crashed run being resumed), is taken
over, and the log says so. Before its manifest is written a stage checks that the claim is still
its own (`Claim.check`), so a run that lost its folder fails instead of replacing another's dataset.

A dataset stage writes only into a folder that is ours: empty, or holding our manifest, or marked
(`MARK`, left by the first claim, so that a run that failed before its manifest can be rerun there).
A folder of the user's own files is refused naming them, `--replace` or not: a commit deletes the
earlier runs' shards by name, and a user's `prompts-00000.parquet` looks like one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Iterator

from dflash_ray import manifest, storage
from dflash_ray.errors import DFlashError

log = logging.getLogger(__name__)

WRITER = "_writer.json"
MARK = "_dflash_ray.json"  # an output folder a dataset stage has claimed: what else is there is its own
DATASET_KINDS = ("prompts", "completions", "tokenized")
TIMEOUT_S = 120.0  # a claim silent this long is stale
RENEW_S = TIMEOUT_S / 4


def _alive_here(claim: dict[str, Any]) -> bool:
    """False when the claim's process ran on this host and is gone."""
    if claim.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(claim["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True


def _read(uri: str) -> dict[str, Any] | None:
    try:
        return json.loads(storage.read_text(uri))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


class Claim:
    def __init__(self, folder: str, kind: str, owner: str):
        self.folder, self.kind, self.owner = folder, kind, owner
        self.uri = storage.join(folder, WRITER)
        self.took_over: dict[str, Any] | None = None
        self.made_from: dict[str, Any] | None = None  # what the run's dataset is made from (its manifest's)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name=f"claim {folder}", daemon=True)

    def _body(self) -> str:
        return json.dumps(
            {
                "owner": self.owner,
                "kind": self.kind,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "heartbeat": time.time(),
            }
        )

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if (_read(self.uri) or {}).get("owner") == self.owner:
                    storage.write_text(self.uri, self._body())
            except Exception as e:  # a storage hiccup: the next beat tries again
                log.warning("renewing the claim on %s: %s", self.folder, e)

    def check(self) -> None:
        """Refuse to commit when another run has taken the folder meanwhile."""
        now = _read(self.uri)
        if (now or {}).get("owner") != self.owner:
            raise DFlashError(
                f"another run took this output while this one ran ({_who(now)}); nothing was "
                "committed: rerun into a folder of its own",
                file=self.folder,
            )

    def release(self) -> None:
        self._stop.set()
        if (_read(self.uri) or {}).get("owner") == self.owner:
            storage.delete(self.uri)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _who(claim: dict[str, Any] | None) -> str:
    if not claim:
        return "its claim is gone"
    age = time.time() - float(claim.get("heartbeat", 0))
    return f"a {claim.get('kind')} run, pid {claim.get('pid')} on {claim.get('host')}, heard from {age:.0f} s ago"


def refuse_if_held(folder: str, doing: str = "writing") -> None:
    """Refuse a folder another live run is writing (its claim fresh, its process not known gone)."""
    held = _read(storage.join(folder, WRITER))
    if held is None:
        return
    fresh = time.time() - float(held.get("heartbeat", 0)) < TIMEOUT_S
    if fresh and _alive_here(held):
        raise DFlashError(
            f"another run is {doing} this output ({_who(held)}); wait for it to end or give "
            f"another folder (a claim silent for {TIMEOUT_S:.0f} s is taken over)",
            file=folder,
        )


def require_ours(folder: str, kind: str | None = None, ours_if: Callable[[], bool] | None = None) -> None:
    """Refuse a folder without our manifest or mark that holds anything (a claim alone is a run of
    ours that died), naming what it holds; and one marked for another kind of output. `ours_if`:
    how the kind's own files show a folder an earlier version wrote before folders were marked."""
    mark = _read(storage.join(folder, MARK))
    if mark is not None:
        if kind is not None and mark.get("kind") not in (kind, None):
            raise DFlashError(
                f"holds a '{mark.get('kind')}' output of dflash-ray ({MARK}); a {kind} run would replace or "
                "mix with it: give an output folder of its own",
                file=folder,
            )
        return
    if storage.exists(storage.join(folder, WRITER)) or (ours_if is not None and ours_if()):
        return
    held = [storage.basename(f) for f in storage.list_files(folder) + storage.skipped_files(folder)]
    held += [storage.basename(d) + "/" for d in storage.list_dirs(folder)]
    if held:
        shown = ", ".join(sorted(held)[:8]) + (f" and {len(held) - 8} more" if len(held) > 8 else "")
        raise DFlashError(
            f"holds {shown}, which no dflash-ray run wrote (no {manifest.MANIFEST} or {MARK}): a run "
            "here could replace or delete them, so nothing was written; give an empty or new folder",
            file=folder,
        )


def claim(
    folder: str,
    kind: str,
    *,
    also: tuple[str, ...] = (),
    made_from: dict[str, Any] | None = None,
    replace: bool = False,
    ours_if: Callable[[], bool] | None = None,
) -> Claim:
    """Claim `folder` for a run writing a `kind` output (`also`: other kinds it may replace): a folder
    of ours (empty, or holding our manifest or mark) or refused. `made_from` (its inputs and settings,
    flat, JSON): a finished output there made from others is refused, naming what differs, unless
    `replace`; the run records it (`Claim.made_from`, and the mark of an output without a manifest)."""
    existing = manifest.read_manifest(folder)
    if existing is not None and existing.get("kind") not in (kind, *also):
        raise DFlashError(
            f"holds a '{existing.get('kind')}' dataset (its {manifest.MANIFEST}); a {kind} run would "
            "replace it: give an output folder of its own",
            file=folder,
        )
    if existing is None:
        require_ours(folder, kind, ours_if)
    made_from = None if made_from is None else json.loads(json.dumps(made_from))
    mark = _read(storage.join(folder, MARK)) if existing is None else None
    before = (existing or mark or {}).get("made_from")
    # a setting one side lacks (newer than the output) is not a difference: the older run did without it
    old, new = before or {}, made_from or {}
    changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    if changed and not replace:
        raise DFlashError(
            f"holds a finished {kind} output made from other {', '.join(changed[:8])}: this run would "
            "replace it; choose another output, or make it anew here (--replace, or delete the folder)",
            file=folder,
        )
    if existing is None:
        body: dict[str, Any] = {"kind": kind, "claimed": time.time()}
        if kind not in DATASET_KINDS and made_from is not None:  # a dataset's is in its manifest
            body["made_from"] = made_from
        storage.write_text(storage.join(folder, MARK), json.dumps(body))
    c = Claim(folder, kind, uuid.uuid4().hex)
    c.made_from = made_from
    held = _read(c.uri)
    if held is not None:
        refuse_if_held(folder)
        log.warning("taking over %s from a run that is gone (%s)", folder, _who(held))
        c.took_over = held
    storage.write_text(c.uri, c._body())
    c.check()  # two claims at once: the last write wins, the other run stops here
    c._thread.start()
    return c


@contextlib.contextmanager
def output(
    folder: str,
    kind: str,
    *,
    also: tuple[str, ...] = (),
    made_from: dict[str, Any] | None = None,
    replace: bool = False,
    what: str = "nothing was written",
    ours_if: Callable[[], bool] | None = None,
) -> Iterator[Claim]:
    """The one door to an output folder, for every command that writes one: a folder (not a file),
    ours or refused (`claim`), held while the block runs; a folder it made is removed again when the
    block fails before writing anything there."""
    storage.require_folder(folder, what)
    local = None if storage.is_s3(folder) else storage.local_path(folder)
    made = local is not None and not local.exists()
    try:
        with claim(folder, kind, also=also, made_from=made_from, replace=replace, ours_if=ours_if) as held:
            yield held
    except BaseException:
        if made and local is not None and local.is_dir():
            left = [p for p in local.iterdir() if p.name not in (MARK, WRITER)]
            if not left:
                for p in local.iterdir():
                    p.unlink()
                local.rmdir()  # the folder the claim made: a failed run leaves nothing
        raise
