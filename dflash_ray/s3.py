"""The S3 client, its settings from the environment, and the clear error for each S3 failure.

`dflash_ray.storage` reads and writes `s3://bucket/key` through here; nothing else needs boto3.
Endpoint, region and credentials come from the standard AWS environment variables
(`AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`, ...) or an instance profile, never
from config files. Transient S3 errors (throttling, 5xx, dropped connections) are retried with
exponential backoff by botocore's standard retry mode; `AWS_MAX_ATTEMPTS` sets the number of tries.
Every try has a deadline: connecting within `DFLASH_RAY_S3_CONNECT_TIMEOUT_S` (default 10 s) and each
read of an answer within `DFLASH_RAY_S3_READ_TIMEOUT_S` (default 10 s), so an endpoint that accepts
and never answers is given up on after the tries (8 x 10 s and the backoff: under two minutes).
Failures a retry cannot fix (no such bucket, access denied, no credentials, an endpoint that does
not answer), and throttling that outlasts the tries, are raised as `DFlashError` naming the URI and
what to set; a missing object as `MissingObject`, which is also a `FileNotFoundError`.
boto3 is imported only where a function needs it: importing this module loads none of it.
"""

from __future__ import annotations

import contextlib
import functools
import os

from dflash_ray import environment
from dflash_ray.errors import DFlashError, MissingObject

PREFIX = "s3://"
DEFAULT_MAX_ATTEMPTS = int(environment.VARIABLES["AWS_MAX_ATTEMPTS"].default)
DEFAULT_CONNECT_TIMEOUT_S = environment.VARIABLES["DFLASH_RAY_S3_CONNECT_TIMEOUT_S"].default
# per read of an answer (a socket read), not per transfer
DEFAULT_READ_TIMEOUT_S = environment.VARIABLES["DFLASH_RAY_S3_READ_TIMEOUT_S"].default


def split(uri: str) -> tuple[str, str]:
    """(bucket, key) of `s3://bucket/key`; a URI with no bucket (`s3://`, `s3:///key`) is refused."""
    bucket, _, key = str(uri)[len(PREFIX) :].partition("/")
    if not bucket:
        raise DFlashError("no bucket in the URI: allowed: s3://BUCKET or s3://BUCKET/KEY", file=str(uri))
    return bucket, key


# ---- settings from the environment ----


def tries() -> int:
    return int(environment.number("AWS_MAX_ATTEMPTS"))


def timeouts() -> tuple[float, float]:
    """The deadlines of one S3 try, in seconds: (connect, each read of an answer), from the environment."""
    return (
        environment.number("DFLASH_RAY_S3_CONNECT_TIMEOUT_S"),
        environment.number("DFLASH_RAY_S3_READ_TIMEOUT_S"),
    )


# ---- the client ----


@functools.lru_cache(maxsize=None)
def _client(pid: int):  # keyed by pid: a client must not cross a fork
    import boto3
    from botocore.config import Config

    connect, read = timeouts()
    config = Config(
        retries={"mode": "standard", "total_max_attempts": tries()}, connect_timeout=connect, read_timeout=read
    )
    try:
        return boto3.client("s3", config=config)
    except ValueError as e:  # botocore's check of the environment's endpoint, region and the like
        raise DFlashError(
            f"the S3 client refuses the environment's settings: {e}",
            field="AWS_ENDPOINT_URL / AWS_REGION (environment)",
        ) from None


def client():
    """This process's S3 client, built once from the environment."""
    return _client(os.getpid())


# ---- what each failure means ----

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
    return client().meta.endpoint_url


def _missing(uri: str) -> MissingObject:
    err = MissingObject("no such S3 object", file=uri)
    err.filename = uri
    return err


_BUCKETS_SEEN: set[str] = set()  # only a bucket known to exist is remembered


def _bucket_exists(bucket: str) -> bool:
    from botocore.exceptions import ClientError

    if bucket not in _BUCKETS_SEEN:
        try:
            client().head_bucket(Bucket=bucket)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING | {"NoSuchBucket"}:
                return False
            raise
        _BUCKETS_SEEN.add(bucket)
    return True


def _no_bucket(uri: str) -> DFlashError:
    bucket, _ = split(uri)
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

    bucket, _ = split(uri)
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
            f"the S3 endpoint {_endpoint()} does not answer: {what} in {tries()} tries of s3:{action} "
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
        tried = int(error.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)) + 1
        return DFlashError(
            f"{_endpoint()} still answered {code} after {tried} tries of s3:{action}: the service is "
            "overloaded or throttling this bucket; raise AWS_MAX_ATTEMPTS (now "
            f"{tries()}) or send fewer requests at "
            "once (fewer generate.generators, a lower tokenize.concurrency)",
            file=uri,
        )
    if code in _BAD_CREDENTIALS:
        return DFlashError(
            f"the S3 service rejected the credentials ({code}): {CREDENTIALS_HINT}, valid for {_endpoint()}", file=uri
        )
    return None


@contextlib.contextmanager
def errors_for(uri: str, action: str):
    """Raise the clear error for an S3 failure inside the block (`action`: the s3: permission it
    needs, as the error names it); let any other pass unchanged."""
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


def head(uri: str, checksums: bool = False) -> dict:
    """The object's metadata, with the checksums S3 keeps of it where `checksums` (`ChecksumMode`);
    a 404 says nothing of which is missing, the object or its bucket."""
    bucket, key = split(uri)
    mode = {"ChecksumMode": "ENABLED"} if checksums else {}
    try:
        with errors_for(uri, "GetObject"):
            return client().head_object(Bucket=bucket, Key=key, **mode)
    except MissingObject:
        with errors_for(uri, "ListBucket"):
            if not _bucket_exists(bucket):
                raise _no_bucket(uri) from None
        raise
