import http.client
import http.server
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_ray import manifest, storage
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
    with pytest.raises(DFlashError, match="part-0.parquet.*100 bytes, found 60"):
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
    _FlakyProxy.target = storage.s3_client().meta.endpoint_url.split("//")[1]
    _FlakyProxy.failures, _FlakyProxy.seen = 2, 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakyProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    storage._s3_client.cache_clear()
    try:
        assert storage.read_text(uri) == "survives throttling"
        assert _FlakyProxy.seen == 3  # two throttled tries, then the one that went through
        _FlakyProxy.failures, _FlakyProxy.seen = 10, 0
        with pytest.raises(Exception, match="SlowDown|503"):
            storage.read_text(uri)  # AWS_MAX_ATTEMPTS=4 in tests: it gives up
        assert _FlakyProxy.seen < 10  # bounded: it did not keep trying
    finally:
        server.shutdown()
        storage._s3_client.cache_clear()
