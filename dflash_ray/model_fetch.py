"""A model folder from S3 onto a node's local disk, fast, once, and resumable.

A 27B target is 54 GB of safetensors. One GetObject stream carries 50-150 MB/s, so a file read
whole, one at a time, makes a cold start of 6-18 minutes; S3 serves many ranges of one object at
once. Here every file is cut into `chunk`-byte ranges and `concurrency` of them (over all the files)
are read at a time, each written in place into `NAME.part`; a chunk written is noted in
`NAME.part.done`, so a fetch killed half way goes on with the chunks it lacks; a file whose chunks
are all in is synced and renamed to NAME. The bytes are counted as they arrive (`progress`), which
is what the stream actors' start-up deadline follows. The caller holds the node's lock
(`registry`): the actors of a node share one copy.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ray import disk, environment, progress, storage
from dflash_ray.errors import DFlashError

DEFAULT_CONCURRENCY = int(environment.VARIABLES["DFLASH_RAY_S3_CONCURRENCY"].default)  # ranged GETs at once
DEFAULT_CHUNK_MB = environment.VARIABLES["DFLASH_RAY_S3_CHUNK_MB"].default  # what one ranged GET asks for


def settings() -> tuple[int, int]:
    """(ranged GETs at once, bytes each) from the environment, where a node's network and the
    store's limits are known."""
    concurrency = environment.number("DFLASH_RAY_S3_CONCURRENCY")  # ranges: `environment.VARIABLES`
    chunk_mb = environment.number("DFLASH_RAY_S3_CHUNK_MB")
    return int(concurrency), int(chunk_mb * (1 << 20))


@dataclass
class _Part:
    """One file being fetched: its size, its chunks, those already written."""

    remote: str
    final: Path
    size: int
    chunk: int
    done: set[int]
    lock: threading.Lock

    @property
    def chunks(self) -> int:
        return max(1, -(-self.size // self.chunk))

    @property
    def part(self) -> Path:
        return self.final.with_name(self.final.name + ".part")

    @property
    def ledger(self) -> Path:
        return self.final.with_name(self.final.name + ".part.done")


def fetch_folder(uri: str, dest: str | Path) -> dict[str, int]:
    """Every file directly under the folder `uri` into `dest`; a file already there at its size is
    kept. Returns the bytes `fetched` now and `kept` from before."""
    concurrency, chunk = settings()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    parts, kept = [], 0
    for remote in storage.list_files(uri):
        final = dest / storage.basename(remote)
        size = storage.size(remote)
        if final.exists() and final.stat().st_size == size:
            kept += size
            continue
        parts.append(_open(remote, final, size, chunk))
    work = [(p, i) for p in parts for i in range(p.chunks) if i not in p.done]
    fetched = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="fetch") as pool:
        for n in pool.map(lambda job: _fetch_chunk(*job), work):
            fetched += n
    for p in parts:
        _close(p)
    return {"fetched": fetched, "kept": kept}


def read_ranges(uri: str, start: int, end: int) -> bytearray:
    """Bytes [start, end) of one file into memory, in ranged GETs run at once (`settings`), each
    counted as it arrives (`progress`)."""
    concurrency, chunk = settings()
    out = bytearray(end - start)

    def one(at: int) -> None:
        data = storage.read_range(uri, at, min(end, at + chunk))
        out[at - start : at - start + len(data)] = data
        progress.add(len(data))

    at = list(range(start, end, chunk))
    if len(at) == 1:
        one(at[0])
    elif at:
        with concurrent.futures.ThreadPoolExecutor(min(concurrency, len(at)), thread_name_prefix="ranges") as pool:
            list(pool.map(one, at))
    return out


def _open(remote: str, final: Path, size: int, chunk: int) -> _Part:
    """The `.part` file at its full size, and the chunks a killed fetch already wrote into it (a
    ledger from another chunk size, or without its part file, starts the file over)."""
    p = _Part(remote, final, size, chunk, set(), threading.Lock())
    if p.part.exists() and p.ledger.exists():
        lines = p.ledger.read_text().split()
        if lines and lines[0] == f"chunk={chunk}":
            p.done = {int(x) for x in lines[1:] if x.isdigit()}
    if not p.done:
        p.ledger.write_text(f"chunk={chunk}\n")
    try:
        with open(p.part, "ab") as f:
            f.truncate(size)
    except OSError as e:
        if disk.no_space(e):
            raise disk.disk_full(p.part, size) from None
        raise
    return p


def _fetch_chunk(p: _Part, index: int) -> int:
    """Read chunk `index` of the file by one ranged GET, write it in place, note it done."""
    start = index * p.chunk
    end = min(p.size, start + p.chunk)
    data = storage.read_range(p.remote, start, end)
    try:
        fd = os.open(p.part, os.O_WRONLY)
        try:
            os.pwrite(fd, data, start)
        finally:
            os.close(fd)
    except OSError as e:
        if disk.no_space(e):
            raise disk.disk_full(p.part, p.size) from None
        raise
    with p.lock:
        with open(p.ledger, "a") as f:
            f.write(f"{index}\n")
    progress.add(len(data))
    return len(data)


def _close(p: _Part) -> None:
    """Every chunk is in: the file is synced and takes its name; the ledger goes."""
    with open(p.part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(p.part, p.final)
    p.ledger.unlink(missing_ok=True)


def measure(uri: str, max_bytes: int) -> dict[str, Any]:
    """The rate ranged reads give here: the first `max_bytes` of the largest file under the folder
    `uri` (or of the file `uri`), read as a fetch reads them, into memory."""
    import time

    files = storage.list_files(uri) if not storage.exists(uri) else [uri]
    if not files:
        raise DFlashError("no file to read there", file=uri)
    sizes = {f: storage.size(f) for f in files}
    largest = max(sizes, key=lambda f: sizes[f])
    n = min(sizes[largest], max_bytes)
    started = time.perf_counter()
    read_ranges(largest, 0, n)
    seconds = time.perf_counter() - started
    concurrency, chunk = settings()
    return {
        "file": largest,
        "bytes": n,
        "seconds": round(seconds, 3),
        "storage_gb_per_s": round(n / 1e9 / seconds, 3) if seconds else 0.0,
        "concurrency": concurrency,
        "chunk_mb": round(chunk / (1 << 20), 3),
    }
