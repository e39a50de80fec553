"""Storage by URI: local paths (plain or `file://`) and `s3://bucket/key`.

Writes are atomic: a local file is written under a temporary name and renamed into place; an S3
object only becomes visible when its PUT (or multipart upload) completes. A dataset made of several
files is complete only once its manifest is written, last (see `dflash_ray.manifest`).

S3 endpoint, region and credentials come from the standard AWS environment variables
(`AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`, ...) or an instance profile, never
from config files. Transient S3 errors (throttling, 5xx, dropped connections) are retried with
exponential backoff by botocore's standard retry mode; `AWS_MAX_ATTEMPTS` sets the number of tries.
Every try has a deadline: connecting within `DFLASH_RAY_S3_CONNECT_TIMEOUT_S` (default 10 s) and each
read of an answer within `DFLASH_RAY_S3_READ_TIMEOUT_S` (default 10 s), so an endpoint that accepts
and never answers is given up on after the tries (8 x 10 s and the backoff: under two minutes).
Failures a retry cannot fix (no such bucket, access denied, no credentials, an endpoint that does
not answer), and throttling that outlasts the tries, are raised as `DFlashError` naming the URI and
what to set; a missing object as `MissingObject`, which is also a `FileNotFoundError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tempfile
import threading
from pathlib import Path

from dflash_ray.errors import DFlashError, DiskFull, MissingObject

S3_PREFIX = "s3://"
DEFAULT_MAX_ATTEMPTS = 8
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 10.0  # per read of an answer (a socket read), not per transfer


def is_s3(uri: str) -> bool:
    return str(uri).startswith(S3_PREFIX)


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


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = str(uri)[len(S3_PREFIX) :].partition("/")
    return bucket, key


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


def _tries() -> int:
    raw = os.environ.get("AWS_MAX_ATTEMPTS", str(DEFAULT_MAX_ATTEMPTS))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise DFlashError(f"{raw!r}: allowed: a whole number of tries >= 1", field="AWS_MAX_ATTEMPTS (environment)")
    return int(raw)


def env_number(name: str, default: float, allowed: str, whole: bool = False) -> float:
    """A positive, finite number from the environment variable `name` (`whole`: an integer), or
    `default`; anything else is refused naming the variable and `allowed`."""
    raw = os.environ.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf") or (whole and value != int(value)):
        raise DFlashError(f"{raw!r}: allowed: {allowed}", field=f"{name} (environment)")
    return value


def timeouts() -> tuple[float, float]:
    """The deadlines of one S3 try, in seconds: (connect, each read of an answer), from the environment."""
    seconds = "a number of seconds > 0"
    return (
        env_number("DFLASH_RAY_S3_CONNECT_TIMEOUT_S", DEFAULT_CONNECT_TIMEOUT_S, seconds),
        env_number("DFLASH_RAY_S3_READ_TIMEOUT_S", DEFAULT_READ_TIMEOUT_S, seconds),
    )


@functools.lru_cache(maxsize=None)
def _s3_client(pid: int):  # keyed by pid: a client must not cross a fork
    import boto3
    from botocore.config import Config

    connect, read = timeouts()
    config = Config(
        retries={"mode": "standard", "total_max_attempts": _tries()}, connect_timeout=connect, read_timeout=read
    )
    try:
        return boto3.client("s3", config=config)
    except ValueError as e:  # botocore's check of the environment's endpoint, region and the like
        raise DFlashError(
            f"the S3 client refuses the environment's settings: {e}",
            field="AWS_ENDPOINT_URL / AWS_REGION (environment)",
        ) from None


def s3_client():
    return _s3_client(os.getpid())


_MISSING = {"NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled", "AccountProblem"}
_BAD_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
}
# the service asks for fewer requests, or is briefly down: retried, and reported once the tries run out
_OVERLOADED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequestsException",
    "RequestThrottled",
    "ServiceUnavailable",
    "503",
    "InternalError",
    "500",
}
CREDENTIALS_HINT = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an "
    "instance profile or IAM role provides credentials"
)


def _endpoint() -> str:
    return s3_client().meta.endpoint_url


def _missing(uri: str) -> MissingObject:
    err = MissingObject("no such S3 object", file=uri)
    err.filename = uri
    return err


_BUCKETS_SEEN: set[str] = set()  # only a bucket known to exist is remembered


def _bucket_exists(bucket: str) -> bool:
    from botocore.exceptions import ClientError

    if bucket not in _BUCKETS_SEEN:
        try:
            s3_client().head_bucket(Bucket=bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING | {"NoSuchBucket"}:
                return False
            raise
        _BUCKETS_SEEN.add(bucket)
    return True


def _no_bucket(uri: str) -> DFlashError:
    bucket, _ = split_s3(uri)
    return DFlashError(
        f"S3 bucket '{bucket}' does not exist at {_endpoint()}: create it or correct the URI "
        "(AWS_ENDPOINT_URL selects a non-AWS S3 service)",
        file=uri,
    )


def _classify(uri: str, action: str, error: Exception) -> Exception | None:
    """The clear error for an S3 failure a retry cannot fix; None for any other."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
        ProxyConnectionError,
        ReadTimeoutError,
    )

    bucket, _ = split_s3(uri)
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return DFlashError(f"no usable AWS credentials for S3 ({error}): {CREDENTIALS_HINT}", file=uri)
    if isinstance(error, (EndpointConnectionError, ConnectionClosedError, ProxyConnectionError, ReadTimeoutError)):
        connect, read = timeouts()
        if isinstance(error, ReadTimeoutError):
            what = f"no answer within {read:g} s (DFLASH_RAY_S3_READ_TIMEOUT_S)"
        elif isinstance(error, ConnectTimeoutError):
            what = f"no connection within {connect:g} s (DFLASH_RAY_S3_CONNECT_TIMEOUT_S)"
        else:
            what = f"no connection ({error})"
        return DFlashError(
            f"the S3 endpoint {_endpoint()} does not answer: {what} in {_tries()} tries of s3:{action} "
            "(AWS_MAX_ATTEMPTS); set AWS_ENDPOINT_URL to the S3 service's address (unset for AWS "
            "itself) and check the network",
            file=uri,
        )
    if not isinstance(error, ClientError):
        return None
    code = str(error.response.get("Error", {}).get("Code", ""))
    if code == "NoSuchBucket":
        return _no_bucket(uri)
    if code in _MISSING:
        return _missing(uri)
    if code in _DENIED:
        return DFlashError(
            f"access denied ({code}) by {_endpoint()}: the credentials in use need s3:{action} "
            f"on bucket '{bucket}' (grant it, or {CREDENTIALS_HINT} that hold it)",
            file=uri,
        )
    if code in _OVERLOADED:
        tries = int(error.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)) + 1
        return DFlashError(
            f"{_endpoint()} still answered {code} after {tries} tries of s3:{action}: the service is "
            "overloaded or throttling this bucket; raise AWS_MAX_ATTEMPTS (now "
            f"{_tries()}) or send fewer requests at "
            "once (fewer generate.generators, a lower tokenize.concurrency)",
            file=uri,
        )
    if code in _BAD_CREDENTIALS:
        return DFlashError(
            f"the S3 service rejected the credentials ({code}): {CREDENTIALS_HINT}, valid for {_endpoint()}", file=uri
        )
    return None


@contextlib.contextmanager
def _s3_errors(uri: str, action: str):
    """Raise the clear error for an S3 failure inside the block; let any other pass unchanged."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (ClientError, BotoCoreError, S3UploadFailedError) as e:
        cause = e.__context__ if isinstance(e, S3UploadFailedError) else e  # the upload's ClientError
        clear = _classify(uri, action, cause) if cause is not None else None
        if clear is None:
            raise
        raise clear from None


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
        bucket, key = split_s3(uri)
        with _s3_errors(uri, "GetObject"):
            data = s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    else:
        data = local_path(uri).read_bytes()
    return _count(data)


def read_range(uri: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file: one ranged GET on S3 (many may run at once on one object)."""
    if end <= start:
        return b""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        with _s3_errors(uri, "GetObject"):
            data = s3_client().get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"].read()
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
        bucket, key = split_s3(uri)
        with _s3_errors(uri, "GetObject"):
            for part in s3_client().get_object(Bucket=bucket, Key=key)["Body"].iter_chunks(chunk):
                digest.update(part)
    else:
        with open(local_path(uri), "rb") as f:
            while part := f.read(chunk):
                digest.update(part)
    return digest.hexdigest()


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def no_space(error: BaseException) -> bool:
    """Whether `error` is a full disk (or quota): errno ENOSPC or EDQUOT, or a library's own words
    for it (safetensors and others pass the OS's message on without its number)."""
    import errno

    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    said = str(error)
    return "No space left on device" in said or "Disk quota exceeded" in said


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} B"


def disk_full(path: str | Path, needed: int | None = None) -> DiskFull:
    """The error of a write the disk had no room for: the path, the bytes the write needed (when
    known) and what is free there. The caller has removed what it left half-written."""
    import shutil

    where = Path(str(path).removeprefix("file://"))
    free = None
    for folder in (where, *where.parents):
        try:
            free = shutil.disk_usage(folder).free
            break
        except OSError:
            continue
    wanted = f"{human_bytes(needed)} to write, " if needed is not None else ""
    room = f"{human_bytes(free)} free there" if free is not None else "the free space is unknown"
    return DiskFull(
        f"no space left on the device ({wanted}{room}): nothing half-written is left; free space "
        "there, or write to a folder on another disk",
        file=str(path),
    )


def write_bytes(uri: str, data: bytes, mode: int = 0o666) -> None:
    """Write atomically: readers see the old object or the whole new one, never a part. A local
    file is made with the umask's permissions, no wider than `mode` (a user's data kept private)."""
    if is_s3(uri):
        import io

        bucket, key = split_s3(uri)
        # upload_fileobj switches to multipart for large payloads; the object appears only when
        # the upload completes.
        with _s3_errors(uri, "PutObject"):
            s3_client().upload_fileobj(io.BytesIO(data), bucket, key)
        return
    path = local_path(uri)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        if no_space(e):
            raise disk_full(path, len(data)) from None
        raise
    try:
        os.fchmod(fd, 0o666 & ~_umask() & mode)  # as `open` would make it: mkstemp's own is 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if no_space(e):
            raise disk_full(path, len(data)) from None
        raise


def _umask() -> int:
    """The process's umask, read without changing it (other threads may be creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)  # no /proc: read it the only other way, and put it back at once
    os.umask(current)
    return current


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
        bucket, key = split_s3(uri)
        with _s3_errors(uri, "PutObject"):
            s3_client().upload_file(str(src), bucket, key)
        return
    import shutil

    dst = local_path(uri)
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.tmp"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if no_space(e):
            raise disk_full(dst, Path(src).stat().st_size) from None
        raise


def exists(uri: str) -> bool:
    if is_s3(uri):
        try:
            _head(uri)
            return True
        except MissingObject:
            return False
    return local_path(uri).exists()


def _head(uri: str) -> dict:
    """The object's metadata; a 404 says nothing of which is missing, the object or its bucket."""
    bucket, key = split_s3(uri)
    try:
        with _s3_errors(uri, "GetObject"):
            return s3_client().head_object(Bucket=bucket, Key=key)
    except MissingObject:
        with _s3_errors(uri, "ListBucket"):
            if not _bucket_exists(bucket):
                raise _no_bucket(uri) from None
        raise


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
        bucket, key = split_s3(prefix)
        key = key.rstrip("/") + "/" if key else ""
        paginator = s3_client().get_paginator("list_objects_v2")
        with _s3_errors(prefix, "ListBucket"):
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
        bucket, key = split_s3(prefix)
        key = key.rstrip("/") + "/" if key else ""
        names = []
        paginator = s3_client().get_paginator("list_objects_v2")
        with _s3_errors(prefix, "ListBucket"):
            for page in paginator.paginate(Bucket=bucket, Prefix=key, Delimiter="/"):
                names += [p["Prefix"][len(key) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
    else:
        folder = local_path(prefix)
        names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    return [join(prefix, n) for n in sorted(names)]


def delete_tree(prefix: str) -> None:
    """Remove a folder and everything under it."""
    if is_s3(prefix):
        bucket, key = split_s3(prefix)
        paginator = s3_client().get_paginator("list_objects_v2")
        with _s3_errors(prefix, "DeleteObject"):
            for page in paginator.paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/"):
                objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if objects:
                    s3_client().delete_objects(Bucket=bucket, Delete={"Objects": objects})
    else:
        import shutil

        shutil.rmtree(local_path(prefix), ignore_errors=True)


def size(uri: str) -> int:
    if is_s3(uri):
        return int(_head(uri)["ContentLength"])
    return local_path(uri).stat().st_size


def delete(uri: str) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        with _s3_errors(uri, "DeleteObject"):
            s3_client().delete_object(Bucket=bucket, Key=key)
    else:
        local_path(uri).unlink(missing_ok=True)


def arrow_filesystem(uri: str):
    """A pyarrow filesystem and path for `uri`, for Ray Data and pyarrow.parquet."""
    import pyarrow.fs as pafs

    if is_s3(uri):
        bucket, key = split_s3(uri)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kwargs: dict[str, str] = {}
        if endpoint:
            scheme, _, host = endpoint.partition("://")
            kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
        connect, read = timeouts()
        retry = pafs.AwsStandardS3RetryStrategy(max_attempts=_tries())
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
