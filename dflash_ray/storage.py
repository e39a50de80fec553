"""Storage by URI: local paths (plain or `file://`) and `s3://bucket/key`.

Writes are atomic: a local file is written under a temporary name and renamed into place
(`dflash_ray.disk`, which also names a full disk); an S3 object only becomes visible when its PUT
(or multipart upload) completes. A dataset made of several files is complete only once its manifest
is written, last (see `dflash_ray.manifest`). The S3 client, its deadlines and retries from the
environment, and the clear error for each S3 failure are `dflash_ray.s3`'s: a missing object is
raised as `MissingObject`, which is also a `FileNotFoundError`.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from dflash_ray import disk, s3
from dflash_ray.errors import DFlashError, MissingObject


def is_s3(uri: str) -> bool:
    return str(uri).startswith(s3.PREFIX)


def local_path(uri: str) -> Path:
    """The local path of `uri`; a scheme nothing here reads (gs://, http://) is named as such, not
    looked for as a file of that name."""
    import re

    uri = str(uri)
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", uri)
    if scheme and scheme.group(1).lower() not in ("file", "s3", "hf"):
        raise DFlashError(
            f"unsupported scheme '{scheme.group(1)}://': local paths, file:// and s3:// are read here "
            "(and hf:// for Hugging Face Hub ids): copy it to one of those first",
            file=uri,
        )
    return Path(uri[len("file://") :] if uri.startswith("file://") else uri)


def require_folder(uri: str, what: str = "nothing was written") -> None:
    """Refuse, before any work, an output folder that is an existing local file."""
    if not is_s3(uri) and local_path(uri).exists() and not local_path(uri).is_dir():
        raise DFlashError(f"is a file, not a folder: {what}; choose a folder", file=uri)


def overlaps(a: str, b: str) -> bool:
    """Whether one of two URIs is the other or lies inside it (local paths resolved, links followed)."""
    if is_s3(a) != is_s3(b):
        return False
    if is_s3(a):
        x, y = a.rstrip("/") + "/", b.rstrip("/") + "/"
    else:
        x, y = _resolved(a) + "/", _resolved(b) + "/"
    return x.startswith(y) or y.startswith(x)


def _resolved(uri: str) -> str:
    """The local path with its links followed; a loop of links is the user's to fix, named."""
    try:
        return str(local_path(uri).resolve())
    except RuntimeError:  # pathlib's "Symlink loop"
        raise DFlashError(
            "a symbolic link that leads back to itself (a loop): nothing there to read", file=uri
        ) from None


def escapes(folder: str, name: object) -> str | None:
    """Why `name`, a path that a dataset or checkpoint in `folder` names relative to itself (a
    manifest's entry, a progress file's shard, a file listed in the folder), leads out of `folder`;
    None when it stays inside. Out: no relative name (empty, absolute, a URI), a `..` part, or, on a
    local disk, a link whose target lies outside the folder. The one rule every such name is held to."""
    if not isinstance(name, str) or not name:
        return "is no file name"
    if name.startswith("/") or "://" in name:
        return "is an absolute path, not one inside the folder"
    if ".." in name.split("/"):
        return "climbs out of the folder with '..'"
    if not is_s3(folder):
        base = Path(_resolved(folder))
        try:
            target = (base / name).resolve()
        except (RuntimeError, OSError):  # a loop of links
            return "is a link that leads round in a loop"
        if not target.is_relative_to(base):
            return f"is a link that leads out of the folder (to {target})"
    return None


def inside(folder: str, name: object, *, file: str, field: str | None = None) -> str:
    """The URI of `name` in `folder`, when `name` stays inside it (`escapes`); otherwise a
    DFlashError naming the `file` and `field` that named it, before anything outside is read."""
    reason = escapes(folder, name)
    if reason is not None:
        raise DFlashError(
            f"names {name!r}, which {reason}: the files a dataset names stay inside its folder; "
            "nothing outside it was read",
            file=file,
            field=field,
        )
    return join(folder, str(name))


def join(base: str, *parts: str) -> str:
    base = str(base)
    if is_s3(base):
        return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
    return str(local_path(base).joinpath(*parts))


def basename(uri: str) -> str:
    return str(uri).rstrip("/").rsplit("/", 1)[-1]


def parent(uri: str) -> str:
    """The folder that holds `uri` (local or s3://)."""
    if is_s3(uri):
        return str(uri).rstrip("/").rsplit("/", 1)[0]
    return str(local_path(uri).parent)


# bytes this process has read through `read_bytes` and `read_range`: what a start-up costs the store
_read = [0]
_read_lock = threading.Lock()


def bytes_read() -> int:
    """Bytes this process has read from storage so far (`read_bytes`, `read_range`)."""
    return _read[0]


def _count(data: bytes) -> bytes:
    with _read_lock:
        _read[0] += len(data)
    return data


def read_bytes(uri: str) -> bytes:
    if is_s3(uri):
        bucket, key = s3.split(uri)
        with s3.errors_for(uri, "GetObject"):
            data = s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    else:
        data = local_path(uri).read_bytes()
    return _count(data)


def read_range(uri: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file: one ranged GET on S3 (many may run at once on one object)."""
    if end <= start:
        return b""
    if is_s3(uri):
        bucket, key = s3.split(uri)
        with s3.errors_for(uri, "GetObject"):
            data = s3.client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()
    else:
        with open(local_path(uri), "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    if len(data) != end - start:
        raise DFlashError(f"asked for bytes {start}-{end} and got {len(data)}: the file changed or is short", file=uri)
    return _count(data)


def sha256(uri: str, chunk: int = 8 << 20) -> str:
    """The hex sha256 of a file, read in chunks (a dataset shard need not fit in memory twice)."""
    import hashlib

    digest = hashlib.sha256()
    if is_s3(uri):
        bucket, key = s3.split(uri)
        with s3.errors_for(uri, "GetObject"):
            for part in s3.client().get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(chunk):
                digest.update(part)
    else:
        with open(local_path(uri), "rb") as f:
            while part := f.read(chunk):
                digest.update(part)
    return digest.hexdigest()


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes, mode: int = 0o666) -> None:
    """Write atomically: readers see the old object or the whole new one, never a part. A local
    file is made with the umask's permissions, no wider than `mode` (a user's data kept private)."""
    if is_s3(uri):
        import io

        bucket, key = s3.split(uri)
        # upload_fileobj switches to multipart for large payloads; the object appears only when
        # the upload completes.
        with s3.errors_for(uri, "PutObject"):
            s3.client().upload_fileobj(io.BytesIO(data), bucket, key)
        return
    disk.write_atomic(local_path(uri), data, mode)


def write_text(uri: str, text: str, mode: int = 0o666) -> None:
    write_bytes(uri, text.encode("utf-8"), mode)


def narrowest_mode(uris: list[str]) -> int:
    """The permissions every local file of `uris` grants (0o666 when none is local): what is written
    from them is made no wider, so a private input's records never land in a world-readable file."""
    mode = 0o666
    for uri in uris:
        if not is_s3(uri) and "://" not in uri:
            try:
                mode &= local_path(uri).stat().st_mode & 0o666
            except OSError:
                continue
    return mode


def upload_file(src: str | Path, uri: str) -> None:
    """Copy a local file to `uri` atomically (used for files too large to hold in memory)."""
    if is_s3(uri):
        bucket, key = s3.split(uri)
        with s3.errors_for(uri, "PutObject"):
            s3.client().upload_file(str(src), bucket, key)
        return
    disk.copy_atomic(src, local_path(uri))


def exists(uri: str) -> bool:
    if is_s3(uri):
        try:
            s3.head(uri)
            return True
        except MissingObject:
            return False
    return local_path(uri).exists()


def list_files(prefix: str, suffix: str | tuple[str, ...] = "") -> list[str]:
    """Files directly under the folder `prefix` whose names end with `suffix` (in any case: `D.JSONL`
    too), sorted. Names starting with `.` or `_` (temporaries, manifests) are left out."""
    taken, _ = _listing(prefix, suffix)
    return taken


def skipped_files(prefix: str, suffix: str | tuple[str, ...] = "") -> list[str]:
    """The files directly under the folder `prefix` that `list_files` leaves out."""
    return _listing(prefix, suffix)[1]


def _listing(prefix: str, suffix: str | tuple[str, ...]) -> tuple[list[str], list[str]]:
    suffixes = tuple(s.lower() for s in ((suffix,) if isinstance(suffix, str) else suffix))
    names: list[str] = []
    unfollowed: list[str] = []  # links: named as skipped
    if is_s3(prefix):
        bucket, key = s3.split(prefix)
        key = key.rstrip("/") + "/" if key else ""
        paginator = s3.client().get_paginator("list_objects_v2")
        with s3.errors_for(prefix, "ListBucket"):
            for page in paginator.paginate(Bucket=bucket, Prefix=key, Delimiter="/"):
                names += [obj["Key"][len(key) :] for obj in page.get("Contents", [])]
    else:
        folder = local_path(prefix)
        if not folder.is_dir():
            return [], []
        names = [p.name for p in folder.iterdir() if p.is_file()]
        # links that lead nowhere (or round in a loop) are no file, but are named as skipped
        unfollowed = [p.name for p in folder.iterdir() if p.is_symlink() and not p.exists()]
        # and links out of the folder are not followed: what a folder holds is what lies in it
        outward = {n: reason for n in names if (reason := escapes(prefix, n)) is not None}
        for n, reason in outward.items():
            _warn_once(join(prefix, n), f"{join(prefix, n)}: {reason}: not followed, not read")
        unfollowed += list(outward)
        names = [n for n in names if n not in outward]
    names = sorted(n for n in names if n)
    keep = [n for n in names if not n.startswith((".", "_")) and n.lower().endswith(suffixes)]
    taken = set(keep)
    skipped = [join(prefix, n) for n in sorted(set(names) - taken | set(unfollowed))]
    return [join(prefix, n) for n in keep], skipped


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """A warning on stderr, once per process for `key` (a folder is listed again by later steps)."""
    if key not in _warned:
        _warned.add(key)
        logging.getLogger(__name__).warning(message)


def list_dirs(prefix: str) -> list[str]:
    """Sub-folders directly under `prefix` (S3: common prefixes), sorted."""
    if is_s3(prefix):
        bucket, key = s3.split(prefix)
        key = key.rstrip("/") + "/" if key else ""
        names = []
        paginator = s3.client().get_paginator("list_objects_v2")
        with s3.errors_for(prefix, "ListBucket"):
            for page in paginator.paginate(Bucket=bucket, Prefix=key, Delimiter="/"):
                names += [p["Prefix"][len(key) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
    else:
        folder = local_path(prefix)
        names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    return [join(prefix, n) for n in sorted(names)]


def delete_tree(prefix: str) -> None:
    """Remove a folder and everything under it."""
    if is_s3(prefix):
        bucket, key = s3.split(prefix)
        paginator = s3.client().get_paginator("list_objects_v2")
        with s3.errors_for(prefix, "DeleteObject"):
            for page in paginator.paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/"):
                objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if objects:
                    s3.client().delete_objects(Bucket=bucket, Delete={"Objects": objects})
    else:
        import shutil

        shutil.rmtree(local_path(prefix), ignore_errors=True)


def size(uri: str) -> int:
    if is_s3(uri):
        return int(s3.head(uri)["ContentLength"])
    return local_path(uri).stat().st_size


# the checksums S3 keeps of a whole object, by the names `fingerprint` gives them
_S3_CHECKSUMS = {
    "ChecksumCRC64NVME": "crc64nvme",
    "ChecksumCRC32C": "crc32c",
    "ChecksumCRC32": "crc32",
    "ChecksumSHA256": "sha256",
    "ChecksumSHA1": "sha1",
}


def fingerprint(uri: str) -> dict:
    """A file's `size`, its `version` (S3: the ETag; local: the modification time), which changes
    whenever its bytes do, and the `checksums` its store keeps of the whole file ({algorithm: hex}):
    S3's full-object checksums, and the ETag as "md5" where it is the MD5 of the bytes (an upload in
    one part, not encrypted by KMS or a customer's key). A multipart object's composite checksum
    (`VALUE-N`) is of its parts, not of its bytes, and is left out."""
    if not is_s3(uri):
        stat = local_path(uri).stat()
        return {"size": stat.st_size, "version": str(stat.st_mtime_ns), "checksums": {}}
    import base64
    import re

    head = s3.head(uri, checksums=True)
    checksums: dict[str, str] = {}
    if head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
        for field, algorithm in _S3_CHECKSUMS.items():
            value = head.get(field)
            if value and "-" not in value:
                checksums[algorithm] = base64.b64decode(value).hex()
    etag = str(head.get("ETag", ""))
    plain = head.get("ServerSideEncryption") in (None, "AES256") and not head.get("SSECustomerAlgorithm")
    if plain and re.fullmatch(r'"?[0-9a-f]{32}"?', etag):
        checksums["md5"] = etag.strip('"')
    return {"size": int(head["ContentLength"]), "version": etag, "checksums": checksums}


def delete(uri: str) -> None:
    if is_s3(uri):
        bucket, key = s3.split(uri)
        with s3.errors_for(uri, "DeleteObject"):
            s3.client().delete_object(Bucket=bucket, Key=key)
    else:
        local_path(uri).unlink(missing_ok=True)


def arrow_filesystem(uri: str):
    """A pyarrow filesystem and path for `uri`, for Ray Data and pyarrow.parquet."""
    import pyarrow.fs as pafs

    if is_s3(uri):
        bucket, key = s3.split(uri)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kwargs: dict[str, str] = {}
        if endpoint:
            scheme, _, host = endpoint.partition("://")
            kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
        connect, read = s3.timeouts()
        retry = pafs.AwsStandardS3RetryStrategy(max_attempts=s3.tries())
        fs = pafs.S3FileSystem(retry_strategy=retry, connect_timeout=connect, request_timeout=read, **kwargs)
        return fs, f"{bucket}/{key}"
    return pafs.LocalFileSystem(), str(local_path(uri).absolute())


def upload_tree(src: str | Path, uri: str, *, skip: dict[str, tuple[int, int]] | None = None) -> None:
    """Copy the files under the local folder `src` to `uri`, keeping their relative paths (links left
    out). With `skip` (relative path -> (size, mtime_ns), updated here), unchanged files are not
    copied again: a folder synced at every checkpoint sends only what changed."""
    for path in sorted(Path(src).rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(src).as_posix()
        stat = path.stat()
        if skip is not None and skip.get(rel) == (stat.st_size, stat.st_mtime_ns):
            continue
        upload_file(path, join(uri, rel))
        if skip is not None:
            skip[rel] = (stat.st_size, stat.st_mtime_ns)


def download_tree(uri: str, dest: str | Path) -> None:
    """Copy every file under the folder `uri` into the local folder `dest` (the reverse of `upload_tree`)."""
    for file in list_files(uri):
        write_bytes(str(Path(dest) / basename(file)), read_bytes(file))
    for folder in list_dirs(uri):
        download_tree(folder, Path(dest) / basename(folder))
