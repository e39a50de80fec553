import http.client
import http.server
import threading
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray import manifest, s3, storage
from dflash_ray.errors import DFlashError


def test_local_atomic_write_replaces_whole_file(tmp_path):
    uri = f"file://{tmp_path}/a/b.txt"
    storage.write_text(uri, "first")
    storage.write_text(uri, "second")
    assert storage.read_text(uri) == "second"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.txt"]  # no temporaries left


def test_local_failed_write_leaves_old_content(tmp_path):
    uri = str(tmp_path / "c.bin")
    storage.write_bytes(uri, b"old")

    with pytest.raises(TypeError):
        storage.write_bytes(uri, object())  # fails mid-write
    assert storage.read_bytes(uri) == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["c.bin"]


def test_list_skips_temporaries_and_manifest(tmp_path):
    for name in ("b.parquet", "a.parquet", "_manifest.json", ".x.tmp", "c.jsonl"):
        (tmp_path / name).write_text("x")
    assert [storage.basename(u) for u in storage.list_files(str(tmp_path), ".parquet")] == ["a.parquet", "b.parquet"]


def test_a_missing_local_folder_lists_nothing(tmp_path):
    assert storage.list_files(str(tmp_path / "missing")) == []
    assert storage.skipped_files(str(tmp_path / "missing")) == []


def test_s3_round_trip(s3_bucket):
    uri = storage.join(s3_bucket, "data", "x.bin")
    payload = bytes(range(256)) * 40_000  # 10 MB: goes through multipart upload
    storage.write_bytes(uri, payload)
    assert storage.exists(uri) and storage.size(uri) == len(payload)
    assert storage.read_bytes(uri) == payload
    storage.write_text(storage.join(s3_bucket, "data", "_manifest.json"), "{}")
    storage.write_text(storage.join(s3_bucket, "data", "sub", "deeper.bin"), "no")
    assert storage.list_files(storage.join(s3_bucket, "data")) == [uri]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(s3_bucket, "missing"))
    storage.delete(uri)
    assert not storage.exists(uri)


def test_s3_parquet_through_arrow_filesystem(s3_bucket):
    import io

    buf = io.BytesIO()
    pq.write_table(pa.table({"a": [1, 2, 3]}), buf)
    uri = storage.join(s3_bucket, "t.parquet")
    storage.write_bytes(uri, buf.getvalue())
    fs, path = storage.arrow_filesystem(uri)
    assert pq.read_table(path, filesystem=fs)["a"].to_pylist() == [1, 2, 3]


def test_manifest_refuses_truncated_file(tmp_path):
    folder = str(tmp_path / "ds")
    storage.write_bytes(storage.join(folder, "part-0.parquet"), b"x" * 100)
    manifest.write_manifest(folder, kind="test", files=[{"name": "part-0.parquet", "rows": 1}], summary={})
    assert manifest.dataset_files(folder) == [storage.join(folder, "part-0.parquet")]
    storage.write_bytes(storage.join(folder, "part-0.parquet"), b"x" * 60)
    with pytest.raises(DFlashError, match="part-0.parquet.*60 bytes, the manifest lists 100"):
        manifest.dataset_files(folder)


def test_manifest_checksums_are_taken_and_checked_on_s3(s3_bucket):
    """`write_manifest` hashes what the writer did not (read back from S3), and a same-size change
    of a listed object is refused by name."""
    folder = f"{s3_bucket}/ds"
    storage.write_bytes(storage.join(folder, "part-0.parquet"), b"x" * (9 << 20))  # over one read chunk
    manifest.write_manifest(folder, kind="tokenized", files=[{"name": "part-0.parquet", "rows": 1}], summary={})
    (entry,) = manifest.read_manifest(folder)["files"]
    assert entry == {"name": "part-0.parquet", "rows": 1, **manifest.file_entry(b"x" * (9 << 20))}
    assert manifest.dataset_files(folder) == [storage.join(folder, "part-0.parquet")]
    storage.write_bytes(storage.join(folder, "part-0.parquet"), b"x" * ((9 << 20) - 1) + b"y")
    with pytest.raises(DFlashError, match="part-0.parquet.*sha256 does not match.*dflash-ray tokenize"):
        manifest.dataset_files(folder)


class _FlakyProxy(http.server.BaseHTTPRequestHandler):
    """Answers the first `failures` requests with S3's 503 SlowDown, then forwards to moto."""

    failures = 0
    seen = 0
    target = ""

    def _handle(self):
        cls = type(self)
        cls.seen += 1
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if cls.seen <= cls.failures:
            err = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(err)))
            self.end_headers()
            self.wfile.write(err)
            return
        host, port = cls.target.split(":")
        conn = http.client.HTTPConnection(host, int(port))
        conn.request(self.command, self.path, body=body, headers=dict(self.headers))
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

    def log_message(self, *args):
        pass


def test_s3_transient_errors_are_retried(s3_bucket, monkeypatch):
    uri = storage.join(s3_bucket, "flaky.txt")
    storage.write_text(uri, "survives throttling")
    _FlakyProxy.target = s3.client().meta.endpoint_url.split("//")[1]
    _FlakyProxy.failures, _FlakyProxy.seen = 2, 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    s3._client.cache_clear()
    try:
        assert storage.read_text(uri) == "survives throttling"
        assert _FlakyProxy.seen == 3  # two throttled tries, then the one that went through
        _FlakyProxy.failures, _FlakyProxy.seen = 10, 0
        with pytest.raises(DFlashError) as e:
            storage.read_text(uri)  # AWS_MAX_ATTEMPTS=4 in tests: it gives up
        assert _FlakyProxy.seen == 4  # AWS_MAX_ATTEMPTS tries in all, the first included
        assert "still answered SlowDown after 4 tries of s3:GetObject" in str(e.value), str(e.value)
        assert "raise AWS_MAX_ATTEMPTS (now 4)" in str(e.value) and e.value.file == uri
    finally:
        server.shutdown()
        s3._client.cache_clear()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Change the AWS environment for one test: the S3 client is rebuilt from it, and again after."""
    import boto3

    s3._client.cache_clear()
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # a session keeps the credentials it found
    yield monkeypatch
    monkeypatch.undo()
    s3._client.cache_clear()


def test_s3_missing_bucket_and_missing_object_name_the_uri(s3_bucket):
    from dflash_ray.errors import MissingObject

    uri = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/data/x.bin"
    calls = {
        "read": lambda: storage.read_bytes(uri),
        "write": lambda: storage.write_bytes(uri, b"x"),
        "exists": lambda: storage.exists(uri),
        "size": lambda: storage.size(uri),
        "list": lambda: storage.list_files(uri.rsplit("/", 1)[0]),
    }
    for name, call in calls.items():
        with pytest.raises(DFlashError) as e:
            call()
        assert "does not exist" in str(e.value) and uri.split("/")[2] in str(e.value), name
        assert "AWS_ENDPOINT_URL" in str(e.value) and not isinstance(e.value, FileNotFoundError), name
    missing = storage.join(s3_bucket, "nothing-here.json")
    assert not storage.exists(missing)  # an existing bucket: a missing object is just absent
    for call in (lambda: storage.read_bytes(missing), lambda: storage.size(missing)):
        with pytest.raises(MissingObject, match="nothing-here.json") as e:
            call()
        assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, DFlashError)


def test_s3_without_credentials_says_what_to_set(s3_bucket, s3_env, tmp_path):
    uri = storage.join(s3_bucket, "x.txt")
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        s3_env.delenv(name, raising=False)
    s3_env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    s3_env.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    s3_env.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance profile to wait for here
    for call in (lambda: storage.read_bytes(uri), lambda: storage.write_text(uri, "x")):
        with pytest.raises(DFlashError, match="AWS_ACCESS_KEY_ID.*instance profile") as e:
            call()
        assert uri in str(e.value)


def test_s3_unreachable_endpoint_says_what_to_set(s3_bucket, s3_env):
    from conftest import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    s3_env.setenv("AWS_ENDPOINT_URL", endpoint)
    s3_env.setenv("AWS_MAX_ATTEMPTS", "1")
    uri = storage.join(s3_bucket, "x.txt")
    with pytest.raises(DFlashError, match="does not answer.*AWS_ENDPOINT_URL") as e:
        storage.read_bytes(uri)
    assert uri in str(e.value) and endpoint in str(e.value)


class _Denied(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that refuses everything, as a bucket policy without rights for these credentials does."""

    def _handle(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = (
            b""
            if self.command == "HEAD"
            else (b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>")
        )
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

    def log_message(self, *args):
        pass


def test_s3_access_denied_names_the_uri_the_right_and_the_bucket(s3_bucket, s3_env):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Denied)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    s3_env.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    uri = storage.join(s3_bucket, "run", "x.txt")
    bucket = s3_bucket[len("s3://") :]
    try:
        for call, right in (
            (lambda: storage.read_bytes(uri), "s3:GetObject"),
            (lambda: storage.exists(uri), "s3:GetObject"),
            (lambda: storage.write_text(uri, "x"), "s3:PutObject"),
            (lambda: storage.list_dirs(storage.join(s3_bucket, "run")), "s3:ListBucket"),
        ):
            with pytest.raises(DFlashError, match="access denied") as e:
                call()
            assert right in str(e.value) and f"'{bucket}'" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)
    finally:
        server.shutdown()


def test_files_are_written_with_the_process_umask(tmp_path):
    """Outputs on a shared cluster are read by other users: a file takes the umask's permissions, as
    `open` gives them (it was 0600 whatever the umask)."""
    import os
    import stat

    from dflash_ray import storage

    old = os.umask(0o022)
    try:
        storage.write_bytes(str(tmp_path / "a" / "f.json"), b"{}")
        os.umask(0o027)
        storage.write_text(str(tmp_path / "g.txt"), "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a" / "f.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "g.txt").stat().st_mode) == 0o640


def test_a_name_a_dataset_gives_stays_inside_its_folder(tmp_path):
    folder = tmp_path / "ds"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.parquet").write_text("x")
    (tmp_path / "secret.txt").write_text("outside")
    (folder / "in.parquet").symlink_to(folder / "a.parquet")
    (folder / "out.parquet").symlink_to(tmp_path / "secret.txt")
    for name in ("a.parquet", "sub/b.parquet", "in.parquet", "..x.parquet"):
        assert storage.escapes(str(folder), name) is None, name
    for name, reason in [
        ("/etc/passwd", "absolute"),
        ("s3://other/key", "absolute"),
        ("../secret.txt", "'..'"),
        ("sub/../../secret.txt", "'..'"),
        ("", "no file name"),
        (None, "no file name"),
        ("out.parquet", "a link that leads out of the folder"),
    ]:
        assert reason in (storage.escapes(str(folder), name) or ""), name
    assert storage.escapes("s3://bucket/ds", "../other/x.parquet") is not None  # on S3 by the name alone
    with pytest.raises(DFlashError) as e:
        storage.inside(str(folder), "../secret.txt", file="m.json", field="files[0].name")
    assert (
        e.value.field == "files[0].name" and "m.json" in str(e.value) and "nothing outside it was read" in str(e.value)
    )
    assert storage.inside(str(folder), "a.parquet", file="m.json") == str(folder / "a.parquet")


def test_a_folder_listing_skips_links_out_of_it_and_names_them(tmp_path, caplog):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_text("{}\n")
    (folder / "b.jsonl").symlink_to(folder / "a.jsonl")  # inside: read
    (tmp_path / "shadow").write_text("root:x\n")
    (folder / "users.jsonl").symlink_to(tmp_path / "shadow")
    with caplog.at_level("WARNING"):
        assert [storage.basename(f) for f in storage.list_files(str(folder), ".jsonl")] == ["a.jsonl", "b.jsonl"]
    assert storage.skipped_files(str(folder), ".jsonl") == [str(folder / "users.jsonl")]
    assert "users.jsonl: is a link that leads out of the folder" in caplog.text


@pytest.mark.parametrize("name", ["../outside/part-0.parquet", "/ABS/outside/part-0.parquet"])
def test_a_manifest_entry_outside_its_folder_is_refused_naming_it(tmp_path, name):
    storage.write_bytes(str(tmp_path / "outside" / "part-0.parquet"), b"y" * 10)  # passes size and sha256
    folder = str(tmp_path / "ds")
    storage.write_bytes(storage.join(folder, "part-0.parquet"), b"y" * 10)
    manifest.write_manifest(folder, kind="tokenized", files=[{"name": "part-0.parquet", "rows": 1}], summary={})
    uri = storage.join(folder, manifest.MANIFEST)
    body = __import__("json").loads(storage.read_text(uri))
    body["files"].append({**body["files"][0], "name": name.replace("/ABS", str(tmp_path))})  # same size and hash
    storage.write_text(uri, __import__("json").dumps(body))
    with pytest.raises(DFlashError) as e:
        manifest.dataset_files(folder)
    assert e.value.field == "files[1].name" and e.value.file == uri


def test_an_s3_endpoint_that_accepts_and_never_answers_is_named_within_the_deadline(tmp_path, monkeypatch, capsys):
    """A listener that takes the connection and says nothing: `prompts --output s3://...` gives up
    after the tries' deadlines, exit 2, naming the endpoint and the URI, with the --json line; the
    default deadlines and tries end within two minutes."""
    import json
    import socket
    import time

    import boto3

    from dflash_ray.cli import main

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept():
        while True:
            try:
                held.append(listener.accept()[0])  # kept open, never read, never answered
            except OSError:  # closed at the test's end
                return

    threading.Thread(target=accept, daemon=True).start()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": "2",
        "DFLASH_RAY_S3_READ_TIMEOUT_S": "1",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    s3._client.cache_clear()
    inputs = tmp_path / "in.jsonl"
    inputs.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    try:
        start = time.monotonic()
        code = main(["prompts", "--input", str(inputs), "--output", "s3://quiet/prompts", "--json"])
        elapsed = time.monotonic() - start
    finally:
        listener.close()
        for conn in held:
            conn.close()
        monkeypatch.undo()
        s3._client.cache_clear()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 2 and summary["exit_code"] == 2 and elapsed < 20, (code, elapsed)
    assert f"the S3 endpoint {endpoint} does not answer: no answer within 1 s" in summary["error"], summary
    assert "s3://quiet/prompts" in summary["error"] and "2 tries" in summary["error"]
    # the defaults: 8 tries of 10 s each, the backoff between them (50 ms doubling) at most 6.35 s
    connect, read = s3.timeouts()
    backoff = sum(min(0.05 * 2**i, 20) for i in range(s3.DEFAULT_MAX_ATTEMPTS - 1))
    assert s3.DEFAULT_MAX_ATTEMPTS * max(connect, read) + backoff < 120


def test_s3_deadlines_in_the_environment_are_checked(monkeypatch):
    monkeypatch.setenv("DFLASH_RAY_S3_READ_TIMEOUT_S", "soon")
    with pytest.raises(DFlashError, match="DFLASH_RAY_S3_READ_TIMEOUT_S"):
        s3.timeouts()
    monkeypatch.setenv("DFLASH_RAY_S3_READ_TIMEOUT_S", "0")
    with pytest.raises(DFlashError, match=r"a number of seconds in \[0.1, 3600\]"):
        s3.timeouts()
    monkeypatch.setenv("DFLASH_RAY_S3_READ_TIMEOUT_S", "2.5")
    assert s3.timeouts() == (s3.DEFAULT_CONNECT_TIMEOUT_S, 2.5)


def _no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_named_with_the_space_needed_and_nothing_half_written_is_left(tmp_path, monkeypatch):
    import os
    import shutil

    from dflash_ray.errors import DiskFull

    uri = str(tmp_path / "out" / "part-0.parquet")
    monkeypatch.setattr(os, "fsync", _no_space)  # the write fails as a full disk's does, after the bytes went out
    with pytest.raises(DiskFull) as e:
        storage.write_bytes(uri, b"x" * 12_345)
    assert str(e.value).startswith(f"{uri}: no space left on the device (12.3 KB to write, ") and "free there" in str(
        e.value
    )
    assert list((tmp_path / "out").iterdir()) == []  # no temporary file left

    src = tmp_path / "big.bin"
    src.write_bytes(b"y" * 2_000)

    def half(a, b, *args, **kwargs):
        open(b, "wb").write(b"y" * 10)  # part of it written, then the disk is full
        _no_space()

    monkeypatch.setattr(shutil, "copyfile", half)
    with pytest.raises(DiskFull, match="2.0 KB to write"):
        storage.upload_file(src, str(tmp_path / "up" / "big.bin"))
    assert list((tmp_path / "up").iterdir()) == []
