"""What a node fetches is what the store holds, across crashes: a chunk whose write a crash lost is
fetched again at the next start, a cached file changed on the disk or in the store is fetched again,
never kept on its size, and bytes that do not match the store's checksum are refused, naming the file.
Against a real S3 server (moto on 127.0.0.1); faults are made where they happen: on the disk, in the
bytes a read returns, in the store."""

from __future__ import annotations

import collections
import os
import random
from pathlib import Path

import pytest

from dflash_ray import model_fetch, storage
from dflash_ray.errors import DFlashError

CHUNK = 64 << 10  # 64 KiB ranges
WEIGHTS = "model-00001-of-00001.safetensors"


@pytest.fixture
def small_ranges(monkeypatch):
    """Ranges of 64 KiB, one at a time: which chunks a killed fetch wrote is then known."""
    monkeypatch.setenv("DFLASH_RAY_S3_CHUNK_MB", str(CHUNK / (1 << 20)))
    monkeypatch.setenv("DFLASH_RAY_S3_CONCURRENCY", "1")


def _model(tmp_path: Path, s3_bucket: str, seed: int = 0) -> tuple[str, dict[str, bytes]]:
    """A folder in S3 (uploaded as boto3 uploads: with a CRC32) of a weights file of six chunks, the
    last one short, and a small config."""
    files = {"config.json": b'{"hidden_size": 64}', WEIGHTS: random.Random(seed).randbytes(5 * CHUNK + 1234)}
    folder = tmp_path / f"source{seed}"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    uri = f"{s3_bucket}/model"
    storage.upload_tree(folder, uri)
    return uri, files


def _same(dest: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (dest / name).read_bytes() == data, name
    assert not list(dest.glob("*.part*")), list(dest.iterdir())


def _killed_after(monkeypatch, reads: int):
    """The node's process dies after `reads` ranged reads; returns the reads that do not."""
    real, calls = storage.read_range, [0]

    def dies(uri, start, end):
        calls[0] += 1
        if calls[0] > reads:
            raise KeyboardInterrupt
        return real(uri, start, end)

    monkeypatch.setattr(storage, "read_range", dies)
    return real


def test_fetch_crash_a_chunk_marked_done_whose_write_was_lost_is_fetched_again(
    tmp_path, s3_bucket, small_ranges, monkeypatch
):
    """Killed after the config and two chunks of the weights; the second's write never reached the
    disk (zeros where the ledger says done). The next start finds it, fetches it and the rest."""
    uri, files = _model(tmp_path, s3_bucket)
    dest = tmp_path / "cache"
    real = _killed_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        model_fetch.fetch_folder(uri, dest)
    monkeypatch.setattr(storage, "read_range", real)
    part = dest / f"{WEIGHTS}.part"
    noted = [line.split()[0] for line in (dest / f"{WEIGHTS}.part.done").read_text().splitlines()]
    assert {"0", "1"} <= set(noted), noted  # the ledger says both are in
    with open(part, "r+b") as f:  # the lost write: chunk 1's bytes are zeros
        f.seek(CHUNK)
        f.write(bytes(CHUNK))

    done = model_fetch.fetch_folder(uri, dest)
    _same(dest, files)
    assert done == {"fetched": len(files[WEIGHTS]) - CHUNK, "kept": 0}, done  # chunk 0 and the config stay


def test_fetch_crash_a_chunk_is_on_the_disk_before_the_ledger_says_so(tmp_path, s3_bucket, small_ranges, monkeypatch):
    """Each time the ledger is synced, every chunk it notes was synced to the part file first."""
    uri, files = _model(tmp_path, s3_bucket)
    synced: collections.Counter[str] = collections.Counter()
    ahead: list[str] = []  # ledger lines synced before their bytes were
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def noting(real):
        def sync(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.endswith(".part.done"):
                lines = Path(path).read_text().splitlines()[1:]
                if len(lines) > synced[path.removesuffix(".done")]:
                    ahead.append(f"{path}: {len(lines)} chunks noted, {synced[path.removesuffix('.done')]} synced")
            synced[path] += 1
            return real(fd)

        return sync

    monkeypatch.setattr(os, "fsync", noting(real_fsync))
    monkeypatch.setattr(os, "fdatasync", noting(real_fdatasync))
    model_fetch.fetch_folder(uri, tmp_path / "cache")
    ledger = str(tmp_path / "cache" / f"{WEIGHTS}.part.done")
    assert ahead == [] and synced[ledger] >= 6, (ahead, synced)
    _same(tmp_path / "cache", files)


def test_integrity_a_cached_file_altered_by_one_byte_is_refused_and_fetched_again(
    tmp_path, s3_bucket, small_ranges, caplog
):
    """A finished file with one byte changed on the disk: never kept on its size; the chunk that
    holds it (and only it) is fetched again, and the file is whole again."""
    uri, files = _model(tmp_path, s3_bucket)
    dest = tmp_path / "cache"
    model_fetch.fetch_folder(uri, dest)
    with open(dest / WEIGHTS, "r+b") as f:
        f.seek(3 * CHUNK + 17)
        byte = f.read(1)
        f.seek(3 * CHUNK + 17)
        f.write(bytes([byte[0] ^ 1]))

    done = model_fetch.fetch_folder(uri, dest)
    _same(dest, files)
    assert done == {"fetched": CHUNK, "kept": len(files["config.json"])}, done
    assert "chunks [3] do not match" in caplog.text, caplog.text
    assert model_fetch.fetch_folder(uri, dest) == {"fetched": 0, "kept": sum(map(len, files.values()))}


def test_integrity_a_cached_file_of_another_version_of_the_object_is_fetched_again(tmp_path, s3_bucket, small_ranges):
    """The object was uploaded again with other bytes of the same size: the copy here is of the old
    one, and is fetched whole again, not kept on its size."""
    uri, _ = _model(tmp_path, s3_bucket)
    dest = tmp_path / "cache"
    model_fetch.fetch_folder(uri, dest)
    _, files = _model(tmp_path, s3_bucket, seed=1)

    done = model_fetch.fetch_folder(uri, dest)
    _same(dest, files)
    assert done["fetched"] == len(files[WEIGHTS]), done


def _upload_with(checksum: str, uri: str, data: bytes) -> None:
    """One object, put so that the store keeps `checksum` of it: a CRC32 or a SHA256, or none (its
    ETag, the MD5 of its bytes, is then the only check)."""
    import boto3
    from botocore.config import Config

    bucket, key = uri[len("s3://") :].split("/", 1)
    if checksum == "md5":
        client = boto3.client("s3", config=Config(request_checksum_calculation="when_required"))
        client.put_object(Bucket=bucket, Key=key, Body=data)
    else:
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm=checksum.upper())
    kept = storage.fingerprint(uri)["checksums"]
    assert checksum in kept and (checksum != "md5" or len(kept) == 1), kept


@pytest.mark.parametrize("checksum", ["crc32", "sha256", "md5"])
def test_integrity_bytes_that_do_not_match_the_stores_checksum_are_refused_naming_the_file(
    tmp_path, s3_bucket, small_ranges, monkeypatch, checksum
):
    """One byte changed on the way (the network, a proxy, the store's read): the file is refused with
    the store's checksum named, nothing of it is kept, and the next start fetches it right."""
    data = random.Random(2).randbytes(3 * CHUNK + 5)
    uri = f"{s3_bucket}/model/{WEIGHTS}"
    _upload_with(checksum, uri, data)
    real = storage.read_range

    def flips_a_byte(u, start, end):
        got = real(u, start, end)
        return got[:10] + bytes([got[10] ^ 0x40]) + got[11:] if start == CHUNK else got

    monkeypatch.setattr(storage, "read_range", flips_a_byte)
    dest = tmp_path / "cache"
    with pytest.raises(DFlashError) as e:
        model_fetch.fetch_folder(f"{s3_bucket}/model", dest)
    said = str(e.value)
    assert said.startswith(uri) and WEIGHTS in e.value.message and "do not match the store's" in said, said
    assert ("ETag" if checksum == "md5" else checksum) in said and "upload it again" in said, said
    assert not list(dest.iterdir()), list(dest.iterdir())  # nothing of it kept

    monkeypatch.setattr(storage, "read_range", real)
    assert model_fetch.fetch_folder(f"{s3_bucket}/model", dest) == {"fetched": len(data), "kept": 0}
    assert (dest / WEIGHTS).read_bytes() == data


def test_integrity_an_object_replaced_while_it_is_fetched_is_refused(tmp_path, s3_bucket, small_ranges, monkeypatch):
    """Someone uploads the model again while a node fetches it: the chunks read after are of the new
    bytes, those before of the old; the mixed copy is refused, not given its name."""
    uri, files = _model(tmp_path, s3_bucket)
    real, calls = storage.read_range, [0]
    replaced = random.Random(3).randbytes(len(files[WEIGHTS]))

    def replaced_after_two(u, start, end):
        calls[0] += 1
        if calls[0] == 3:
            storage.write_bytes(f"{uri}/{WEIGHTS}", replaced)
        return real(u, start, end)

    monkeypatch.setattr(storage, "read_range", replaced_after_two)
    dest = tmp_path / "cache"
    with pytest.raises(DFlashError, match="changed in the store while it was fetched") as e:
        model_fetch.fetch_folder(uri, dest)
    assert str(e.value).startswith(f"{uri}/{WEIGHTS}"), str(e.value)
    assert not (dest / WEIGHTS).exists() and not list(dest.glob("*.part*"))
