"""A model folder from S3 onto a node's local disk, fast, once, resumable, and never silently wrong.

A 27B target is 54 GB of safetensors. One GetObject stream carries 50-150 MB/s, so a file read
whole, one at a time, makes a cold start of 6-18 minutes; S3 serves many ranges of one object at
once. Here every file is cut into `chunk`-byte ranges and `concurrency` of them (over all the files)
are read at a time, each written in place into `NAME.part`; a chunk is noted in `NAME.part.done`,
with the sha256 of its bytes as they arrived, only once those bytes are on the disk (the part synced,
then the ledger's line), so a fetch killed half way goes on with the chunks it lacks. The bytes are
counted as they arrive (`progress`), which is what the stream actors' start-up deadline follows. The
caller holds the node's lock (`registry`): the actors of a node share one copy.

Training runs for days on what is here, so nothing is trusted on its size alone (a crash can lose a
write the disk had claimed, leaving zeros; a disk can change a byte later):
- at a restart every chunk the ledger marks done is read back against its digest; one that does not
  match is fetched again;
- a file whose chunks are all in is read once against the checksum its store keeps (S3's full-object
  CRC or SHA, or a single-part ETag: the MD5 of the bytes) before it takes its name; a mismatch is
  refused, naming the file, and nothing of it is kept;
- its record, `.NAME.fetched.json`, holds the object's version (its ETag) and size, the checksum it
  was checked against, and the chunk digests: the record where the store keeps no checksum;
- a file already here is kept only when its record is of the object the store holds now and its bytes
  match the record's digests (one read of them, chunks in parallel); a chunk that does not match is
  fetched again, a file with no record, or a record of another version, is fetched whole.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ray import disk, environment, progress, storage
from dflash_ray.errors import DFlashError

DEFAULT_CONCURRENCY = int(environment.VARIABLES["DFLASH_RAY_S3_CONCURRENCY"].default)  # ranged GETs at once
DEFAULT_CHUNK_MB = environment.VARIABLES["DFLASH_RAY_S3_CHUNK_MB"].default  # what one ranged GET asks for
BLOCK = 8 << 20  # bytes read at a time when checking a file: large reads, little memory per thread
LEDGER_HEADER = re.compile(r"chunk=(\d+) size=(\d+) version=(\S*)")
LEDGER_LINE = re.compile(r"(\d+) ([0-9a-f]{64})")
log = logging.getLogger(__name__)


def settings() -> tuple[int, int]:
    """(ranged GETs at once, bytes each) from the environment, where a node's network and the
    store's limits are known."""
    concurrency = environment.number("DFLASH_RAY_S3_CONCURRENCY")  # ranges: `environment.VARIABLES`
    chunk_mb = environment.number("DFLASH_RAY_S3_CHUNK_MB")
    return int(concurrency), int(chunk_mb * (1 << 20))


@dataclass
class _Part:
    """One file: the object it comes from (`storage.fingerprint`), its chunks, and those already on
    the disk with their digests; `whole` while the bytes are under the file's own name."""

    remote: str
    final: Path
    source: dict[str, Any]
    chunk: int
    done: dict[int, str] = field(default_factory=dict)
    whole: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def size(self) -> int:
        return int(self.source["size"])

    @property
    def chunks(self) -> int:
        return max(1, -(-self.size // self.chunk))

    def span(self, index: int) -> tuple[int, int]:
        return index * self.chunk, min(self.size, (index + 1) * self.chunk)

    @property
    def part(self) -> Path:
        return self.final.with_name(self.final.name + ".part")

    @property
    def ledger(self) -> Path:
        return self.final.with_name(self.final.name + ".part.done")

    @property
    def record(self) -> Path:
        return _record_path(self.final)

    @property
    def header(self) -> str:
        """The ledger's first line: chunks noted under another one are of another fetch."""
        return f"chunk={self.chunk} size={self.size} version={self.source['version']}"


def fetch_folder(uri: str, dest: str | Path) -> dict[str, int]:
    """Every file directly under the folder `uri` into `dest`, each checked against its store's
    checksum before it takes its name; a file already there is kept when its record is of the
    object there now and its bytes match it. Returns the bytes `fetched` now and `kept` from before."""
    concurrency, chunk = settings()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    files = [
        _open(remote, dest / storage.basename(remote), storage.fingerprint(remote), chunk)
        for remote in storage.list_files(uri)
    ]
    threads = max(1, concurrency)
    _check(files, threads)
    parts, kept = [], 0
    for p in files:
        if p.whole and len(p.done) == p.chunks:
            kept += p.size
            continue
        if p.whole:
            _reopen(p)
        parts.append(p)
    work = [(p, i) for p in parts for i in range(p.chunks) if i not in p.done]
    fetched = 0
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fetch") as pool:
        for n in pool.map(lambda job: _fetch_chunk(*job), work):
            fetched += n
        list(pool.map(_close, parts))  # each file read once against its checksum: in parallel
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


def _open(remote: str, final: Path, source: dict[str, Any], chunk: int) -> _Part:
    """What of the file is here, as claimed (and checked next, `_check`): a whole file's chunks by its
    record, a killed fetch's by its ledger, whose chunk size it keeps. A file with no record, or one
    of another version of the object, and a ledger of another version or without its part file,
    start the file over."""
    record = _record_of(final, source)
    if record is not None:
        p = _Part(remote, final, source, record["chunk"], dict(enumerate(record["sha256"])), whole=True)
        p.ledger.unlink(missing_ok=True)  # a crash between the rename and the ledger's removal left it
        return p
    if final.exists():
        log.warning("%s: no record of its bytes, or one of another version of %s: fetched again", final, remote)
        final.unlink()
    p = _Part(remote, final, source, chunk)
    if p.part.exists() and p.ledger.exists():
        lines = p.ledger.read_text(errors="replace").splitlines()
        header = LEDGER_HEADER.fullmatch(lines[0]) if lines else None
        if header and int(header[1]) > 0 and int(header[2]) == p.size and header[3] == source["version"]:
            p.chunk = int(header[1])
            noted = (LEDGER_LINE.fullmatch(line) for line in lines[1:])
            p.done = {int(m[1]): m[2] for m in noted if m and int(m[1]) < p.chunks}
    if not p.done:
        disk.write_atomic(p.ledger, f"{p.header}\n".encode())
    try:
        with open(p.part, "ab") as f:
            f.truncate(p.size)
    except OSError as e:
        if disk.no_space(e):
            raise disk.disk_full(p.part, p.size) from None
        raise
    return p


def _record_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.fetched.json")


def _record_of(final: Path, source: dict[str, Any]) -> dict[str, Any] | None:
    """The record of the file at `final` where it is one of the object's version in the store now
    and of a file of its size; None otherwise (no file, no record, a damaged one)."""
    try:
        record = json.loads(_record_path(final).read_text())
        size = final.stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (record.get("size"), record.get("version")) != (size, source["version"]):
        return None
    chunk, digests = record.get("chunk"), record.get("sha256")
    if size != source["size"] or not isinstance(chunk, int) or chunk <= 0 or not isinstance(digests, list):
        return None
    return record if len(digests) == max(1, -(-size // chunk)) else None


def _check(files: list[_Part], threads: int) -> None:
    """Read back every chunk claimed done and drop each whose bytes do not match its digest: a write a
    crash lost (zeros where the ledger said done), a byte changed on the disk. One read of those
    bytes, the chunks in parallel."""

    def matches(job: tuple[_Part, int]) -> bool:
        p, index = job
        start, end = p.span(index)
        digest = _sha256(p.final if p.whole else p.part, start, end)
        progress.add(end - start)
        return digest == p.done[index]

    jobs = [(p, i) for p in files for i in sorted(p.done)]
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="check") as pool:
        results = list(pool.map(matches, jobs))
    failed: dict[Path, list[int]] = {}
    for (p, index), ok in zip(jobs, results):
        if not ok:
            del p.done[index]
            failed.setdefault(p.final if p.whole else p.part, []).append(index)
    for path, indices in failed.items():
        log.warning(
            "%s: chunks %s do not match the digests noted as their bytes arrived (a write lost in a crash, "
            "or the disk changed them): fetched again",
            path,
            indices,
        )


def _sha256(path: Path, start: int, end: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while start < end and (data := f.read(min(BLOCK, end - start))):
            digest.update(data)
            start += len(data)
    return digest.hexdigest()


def _reopen(p: _Part) -> None:
    """A whole file some of whose chunks failed their check becomes a part again: the chunks that
    passed stay, the others are fetched again, and the whole is checked against its store again."""
    noted = "".join(f"{i} {digest}\n" for i, digest in sorted(p.done.items()))
    disk.write_atomic(p.ledger, f"{p.header}\n{noted}".encode())
    os.replace(p.final, p.part)
    p.record.unlink(missing_ok=True)
    p.whole = False


def _fetch_chunk(p: _Part, index: int) -> int:
    """Read chunk `index` of the file by one ranged GET, write it in place, and once it is on the
    disk note it done with its digest (a crash then loses the line or keeps the bytes, never the
    bytes alone)."""
    start, end = p.span(index)
    data = storage.read_range(p.remote, start, end)
    digest = hashlib.sha256(data).hexdigest()
    try:
        fd = os.open(p.part, os.O_WRONLY)
        try:
            view, at = memoryview(data), 0
            while at < len(data):  # a write may take less than it is given (Linux: 2 GiB at most)
                at += os.pwrite(fd, view[at:], start + at)
            os.fdatasync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if disk.no_space(e):
            raise disk.disk_full(p.part, p.size) from None
        raise
    with p.lock:
        with open(p.ledger, "a") as f:
            f.write(f"{index} {digest}\n")
            f.flush()
            os.fsync(f.fileno())
        p.done[index] = digest
    progress.add(len(data))
    return len(data)


def _close(p: _Part) -> None:
    """Every chunk is in: the object must still be the one fetched, and the file's bytes must match
    the checksum its store keeps (one read); then its record is written, it takes its name, and the
    folder is synced so that both survive a crash; the ledger goes. A refused file leaves nothing."""
    now = storage.fingerprint(p.remote)["version"]
    if now != p.source["version"]:
        _discard(p)
        raise DFlashError(
            f"changed in the store while it was fetched (version {p.source['version']}, now {now}): the "
            "mixed copy was removed, not loaded; start again once nothing writes to the object",
            file=p.remote,
        )
    checksum = _store_check(p)
    record = {
        "size": p.size,
        "version": p.source["version"],
        "checksum": checksum,
        "chunk": p.chunk,
        "sha256": [p.done[i] for i in range(p.chunks)],
    }
    disk.write_atomic(p.record, json.dumps(record).encode())
    os.replace(p.part, p.final)
    fd = os.open(p.final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the record's name and the file's, on the disk
    finally:
        os.close(fd)
    p.ledger.unlink(missing_ok=True)


def _store_check(p: _Part) -> list[str] | None:
    """[algorithm, hex] of the store's checksum of the file once the part's bytes match it (one read of
    them); None where the store keeps none this process computes (the chunk digests are then the
    record). A mismatch removes the part and is refused, naming the file and what to do."""
    algorithm = next((a for a in _computable() if a in p.source["checksums"]), None)
    if algorithm is None:
        return None
    hasher = _hasher(algorithm)
    with open(p.part, "rb", buffering=0) as f:
        while data := f.read(BLOCK):
            hasher.update(data)
            progress.add(len(data))
    got, want = hasher.digest().hex(), p.source["checksums"][algorithm]
    if got != want:
        _discard(p)
        what = "ETag (the MD5 of an object uploaded in one part)" if algorithm == "md5" else f"{algorithm} checksum"
        raise DFlashError(
            f"the bytes fetched to {p.final} do not match the store's {what}: {got}, where the store "
            f"says {want}. They were removed, not loaded, and the next start fetches the file whole "
            "again; if it repeats, the object's bytes do not match the checksum its store keeps: "
            "upload it again, with a checksum (aws s3 cp --checksum-algorithm CRC32)",
            file=p.remote,
        )
    return [algorithm, got]


def _discard(p: _Part) -> None:
    p.part.unlink(missing_ok=True)
    p.ledger.unlink(missing_ok=True)


class _Crc:
    """A CRC behind hashlib's `update` and `digest`, its value as S3 gives it (big-endian bytes)."""

    def __init__(self, update: Any, width: int):
        self._update, self.width, self.value = update, width, 0

    def update(self, data: bytes) -> None:
        self.value = self._update(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(self.width, "big")


def _computable() -> tuple[str, ...]:
    """The store checksums this process computes, fastest first: CRC32C and CRC64NVME (what S3 gives
    a multipart object by default) need botocore's optional accelerator, awscrt."""
    try:
        import importlib

        crt = importlib.import_module("awscrt.checksums")
        fast = tuple(a for a in ("crc64nvme", "crc32c") if hasattr(crt, a))
    except ImportError:
        fast = ()
    return (*fast, "crc32", "sha256", "sha1", "md5")


def _hasher(algorithm: str) -> Any:
    if algorithm == "crc32":
        return _Crc(zlib.crc32, 4)
    if algorithm in ("crc32c", "crc64nvme"):
        import importlib

        return _Crc(getattr(importlib.import_module("awscrt.checksums"), algorithm), 4 if algorithm == "crc32c" else 8)
    return hashlib.new(algorithm)


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
