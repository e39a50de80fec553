"""Storage by URI: local paths (plain or `file://`) and `s3://bucket/key`.

Writes are atomic: a local file is written under a temporary name and renamed into place; an S3
object only becomes visible when its PUT (or multipart upload) completes. A dataset made of several
files is complete only once its manifest is written, last (see `dflash_ray.manifest`).

S3 endpoint, region and credentials come from the standard AWS environment variables
(`AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`, ...) or an instance profile, never
from config files. Transient S3 errors (throttling, 5xx, dropped connections) are retried with
exponential backoff by botocore's standard retry mode; `AWS_MAX_ATTEMPTS` sets the number of tries.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

S3_PREFIX = "s3://"
DEFAULT_MAX_ATTEMPTS = 8


def is_s3(uri: str) -> bool:
    return str(uri).startswith(S3_PREFIX)


def local_path(uri: str) -> Path:
    uri = str(uri)
    return Path(uri[len("file://"):] if uri.startswith("file://") else uri)


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = str(uri)[len(S3_PREFIX):].partition("/")
    return bucket, key


def join(base: str, *parts: str) -> str:
    base = str(base)
    if is_s3(base):
        return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
    return str(local_path(base).joinpath(*parts))


def basename(uri: str) -> str:
    return str(uri).rstrip("/").rsplit("/", 1)[-1]


@functools.lru_cache(maxsize=None)
def _s3_client(pid: int):  # keyed by pid: a client must not cross a fork
    import boto3
    from botocore.config import Config

    attempts = int(os.environ.get("AWS_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS))
    return boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": attempts}))


def s3_client():
    return _s3_client(os.getpid())


def read_bytes(uri: str) -> bytes:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        try:
            return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except s3_client().exceptions.NoSuchKey:
            raise FileNotFoundError(uri) from None
    return local_path(uri).read_bytes()


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_bytes(uri: str, data: bytes) -> None:
    """Write atomically: readers see the old object or the whole new one, never a part."""
    if is_s3(uri):
        import io

        bucket, key = split_s3(uri)
        # upload_fileobj switches to multipart for large payloads; the object appears only when
        # the upload completes.
        s3_client().upload_fileobj(io.BytesIO(data), bucket, key)
        return
    path = local_path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def upload_file(src: str | Path, uri: str) -> None:
    """Copy a local file to `uri` atomically (used for files too large to hold in memory)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        s3_client().upload_file(str(src), bucket, key)
        return
    import shutil

    dst = local_path(uri)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def exists(uri: str) -> bool:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        from botocore.exceptions import ClientError

        try:
            s3_client().head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
    return local_path(uri).exists()


def list_files(prefix: str, suffix: str | tuple[str, ...] = "") -> list[str]:
    """Files directly under the folder `prefix` whose names end with `suffix`, sorted.

    Names starting with `.` or `_` (temporaries, manifests) are left out.
    """
    suffixes = (suffix,) if isinstance(suffix, str) else suffix
    names: list[str] = []
    if is_s3(prefix):
        bucket, key = split_s3(prefix)
        key = key.rstrip("/") + "/" if key else ""
        paginator = s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=key, Delimiter="/"):
            names += [obj["Key"][len(key):] for obj in page.get("Contents", [])]
    else:
        folder = local_path(prefix)
        if not folder.is_dir():
            return []
        names = [p.name for p in folder.iterdir() if p.is_file()]
    keep = [n for n in names if n and not n.startswith((".", "_")) and n.endswith(suffixes)]
    return [join(prefix, n) for n in sorted(keep)]


def list_dirs(prefix: str) -> list[str]:
    """Sub-folders directly under `prefix` (S3: common prefixes), sorted."""
    if is_s3(prefix):
        bucket, key = split_s3(prefix)
        key = key.rstrip("/") + "/" if key else ""
        names = []
        paginator = s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=key, Delimiter="/"):
            names += [p["Prefix"][len(key):].rstrip("/") for p in page.get("CommonPrefixes", [])]
    else:
        folder = local_path(prefix)
        names = [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    return [join(prefix, n) for n in sorted(names)]


def delete_tree(prefix: str) -> None:
    """Remove a folder and everything under it."""
    if is_s3(prefix):
        bucket, key = split_s3(prefix)
        paginator = s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=key.rstrip("/") + "/"):
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                s3_client().delete_objects(Bucket=bucket, Delete={"Objects": objects})
    else:
        import shutil

        shutil.rmtree(local_path(prefix), ignore_errors=True)


def size(uri: str) -> int:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        return int(s3_client().head_object(Bucket=bucket, Key=key)["ContentLength"])
    return local_path(uri).stat().st_size


def delete(uri: str) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        s3_client().delete_object(Bucket=bucket, Key=key)
    else:
        local_path(uri).unlink(missing_ok=True)


def arrow_filesystem(uri: str):
    """A pyarrow filesystem and path for `uri`, for Ray Data and pyarrow.parquet."""
    import pyarrow.fs as pafs

    if is_s3(uri):
        bucket, key = split_s3(uri)
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        kwargs = {}
        if endpoint:
            scheme, _, host = endpoint.partition("://")
            kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
        retry = pafs.AwsStandardS3RetryStrategy(
            max_attempts=int(os.environ.get("AWS_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS)))
        return pafs.S3FileSystem(retry_strategy=retry, **kwargs), f"{bucket}/{key}"
    return pafs.LocalFileSystem(), str(local_path(uri).absolute())
